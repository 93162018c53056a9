"""Only the C extensions; everything else about the package is in pyproject.toml.

Declared here rather than in pyproject.toml, where setuptools still calls ext-modules experimental. gateway/native/
is the one module that imports them, and names the Python twin that does each one's work where it did not build.
Optional by default (an install without a compiler goes on, slower); AGENT_GATEWAY_NATIVE=required makes a failed
build an error, as the image's build stage (deploy/Dockerfile) sets it.
"""

import os

from setuptools import Extension, setup

OPTIONAL = os.environ.get("AGENT_GATEWAY_NATIVE", "optional") != "required"

setup(
    ext_modules=[
        Extension("gateway.native._ngram_score", ["gateway/native/_ngram_score.c"], optional=OPTIONAL),
        Extension("gateway.native._ask_cues", ["gateway/native/_ask_cues.c"], optional=OPTIONAL),
        Extension("gateway.native._features_walk", ["gateway/native/_features_walk.c"], optional=OPTIONAL),
    ]
)
