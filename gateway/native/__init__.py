"""The C extensions, kept in this folder and imported here and nowhere else: each one's module where it built, else
None and its Python twin.

Native code only where the workload pays for it (docs/performance.md, 'Why the code is shaped so'): the n-gram text
score (a dict walk misses cache and TLB across the weights' many Python objects, even for a short prompt), the ask's
cues and the chat walk of the features. Each has a Python twin that gives the same results, slower; it is the reference
the extension is tested against, and what runs where a compiler was missing at install (setup.py builds them optionally,
except in the image, whose build stage requires them). Which of them runs is logged at start and exported as
gateway_native_info.
"""

from __future__ import annotations

__all__ = ["TWINS", "ask_cues", "describe", "features_walk", "loaded", "ngram_score"]

try:
    import gateway.native._ngram_score as ngram_score
except ImportError:
    ngram_score = None  # type: ignore[assignment]
try:
    import gateway.native._ask_cues as ask_cues
except ImportError:
    ask_cues = None  # type: ignore[assignment]
try:
    import gateway.native._features_walk as features_walk
except ImportError:
    features_walk = None  # type: ignore[assignment]

# Each extension (setup.py's module name) and the Python twin that does its work where it did not build.
TWINS = {
    "gateway.native._ngram_score": "gateway.classifier.ngrams (the dict walk)",
    "gateway.native._ask_cues": "gateway.classifier.cues (re and str methods)",
    "gateway.native._features_walk": "gateway.features (the Python walk)",
}


def loaded() -> dict[str, bool]:
    """Each extension by its module name: True when it is imported, False when its Python twin runs."""
    modules = {"gateway.native._ngram_score": ngram_score, "gateway.native._ask_cues": ask_cues,
               "gateway.native._features_walk": features_walk}
    return {name: module is not None for name, module in modules.items()}


def describe() -> str:
    """One log line: which extensions are loaded, which Python twins run in place of the others."""
    status = loaded()
    running = [name for name, ok in status.items() if ok]
    missing = [f"{name} (not built: {TWINS[name]} runs)" for name, ok in status.items() if not ok]
    return "C extensions loaded: " + (", ".join(running) or "none") + ("; " + ", ".join(missing) if missing else "")
