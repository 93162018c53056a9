"""Only the classifier's C extensions; everything else about the package is in pyproject.toml.

Declared here rather than in pyproject.toml, where setuptools still calls ext-modules experimental.
Optional: where one cannot compile, the install goes on and its Python twin serves instead
(gateway/classifier/ngrams.py scores, gateway/classifier/cues.py reads the ask).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("gateway.classifier._ngram_score", ["gateway/classifier/_ngram_score.c"], optional=True),
        Extension("gateway.classifier._ask_cues", ["gateway/classifier/_ask_cues.c"], optional=True),
    ]
)
