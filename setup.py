"""Only the C extensions; everything else about the package is in pyproject.toml.

Declared here rather than in pyproject.toml, where setuptools still calls ext-modules experimental.
Optional: where one cannot compile, the install goes on and its Python twin does the work (same results, slower):
gateway/classifier/ngrams.py scores without _ngram_score, gateway/classifier/cues.py reads the ask without
_ask_cues, gateway/classifier/inputs.py sums a model's terms without _terms, gateway/features.py walks a chat
without _features_walk, and gateway/telemetry/otlp.py encodes spans without _otlp_text.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("gateway.classifier._ngram_score", ["gateway/classifier/_ngram_score.c"], optional=True),
        Extension("gateway.classifier._ask_cues", ["gateway/classifier/_ask_cues.c"], optional=True),
        # -ffp-contract=off: no fused multiply-add, each step the IEEE operation Python's float does (the same sum)
        Extension("gateway.classifier._terms", ["gateway/classifier/_terms.c"], optional=True,
                  extra_compile_args=["-ffp-contract=off"]),
        Extension("gateway._features_walk", ["gateway/_features_walk.c"], optional=True),
        Extension("gateway.telemetry._otlp_text", ["gateway/telemetry/_otlp_text.c"], optional=True),
    ]
)
