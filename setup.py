"""Only the classifier's C extension; everything else about the package is in pyproject.toml.

Declared here rather than in pyproject.toml, where setuptools still calls ext-modules experimental.
Optional: where it cannot compile, the install goes on and gateway/classifier/ngrams.py scores in Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("gateway.classifier._ngram_score", ["gateway/classifier/_ngram_score.c"], optional=True)])
