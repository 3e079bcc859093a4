"""``text_similarity`` metrics, each computed by the library the field uses for it.

=================  ===========================================================================
metric             computed as (0..1)
=================  ===========================================================================
fuzzy_match        ``rapidfuzz.fuzz.WRatio`` with ``utils.default_process`` / 100 (the form
                   OpenAI's graders guide shows for rapidfuzz)
bleu               ``sacrebleu.sentence_bleu`` (13a tokens, exponential smoothing) / 100
gleu               ``nltk`` ``sentence_gleu`` (Google BLEU) on sacrebleu's 13a tokens (as
                   Hugging Face ``evaluate``'s google_bleu tokenizes)
meteor             ``nltk`` ``single_meteor_score`` on 13a tokens; needs NLTK's ``wordnet``
                   corpus (``NLTK_DATA``); without it the metric is refused at validation
rouge_1..rouge_5   ``rouge_score`` ``RougeScorer(["rougeN"])`` F-measure, no stemming
rouge_l            ``rouge_score`` ``rougeL`` F-measure
cosine             refused: it needs an embedding model (OpenAI offers it for evals only)
=================  ===========================================================================

``similarity(metric, input, reference)`` computes one; ``unavailable_reason(metric)`` says
why a metric cannot be computed here (None when it can). Libraries load on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

ROUGE_TYPES = {"rouge_1": "rouge1", "rouge_2": "rouge2", "rouge_3": "rouge3", "rouge_4": "rouge4",
               "rouge_5": "rouge5", "rouge_l": "rougeL"}


def fuzzy_match(text: str, reference: str) -> float:
    from rapidfuzz import fuzz, utils

    return fuzz.WRatio(text, reference, processor=utils.default_process) / 100.0


def bleu(text: str, reference: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_bleu(text, [reference]).score / 100.0


@cache
def _tokenizer_13a() -> Callable[[str], str]:
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()


def tokens(text: str) -> list[str]:
    return _tokenizer_13a()(text).split()


def gleu(text: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([tokens(reference)], tokens(text)))


def meteor(text: str, reference: str) -> float:
    from nltk.translate.meteor_score import single_meteor_score

    return float(single_meteor_score(tokens(reference), tokens(text)))


@cache
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type], use_stemmer=False)


def rouge(metric: str) -> Callable[[str, str], float]:
    rouge_type = ROUGE_TYPES[metric]

    def score(text: str, reference: str) -> float:
        return float(_rouge_scorer(rouge_type).score(reference, text)[rouge_type].fmeasure)

    return score


METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": fuzzy_match, "bleu": bleu, "gleu": gleu, "meteor": meteor,
    **{metric: rouge(metric) for metric in ROUGE_TYPES},
}


def wordnet_available() -> bool:
    import nltk

    try:
        nltk.data.find("corpora/wordnet")
    except LookupError:
        try:
            nltk.data.find("corpora/wordnet.zip")
        except LookupError:
            return False
    return True


def unavailable_reason(metric: str) -> str | None:
    """Why ``metric`` cannot be computed on this machine, or None."""
    if metric == "cosine":
        return ("evaluation_metric 'cosine' needs an embedding model; as on OpenAI, it is offered for evals "
                "only, not for fine-tuning graders.")
    if metric == "meteor" and not wordnet_available():
        return ("evaluation_metric 'meteor' needs NLTK's 'wordnet' corpus, which this deployment does not "
                "have (an operator installs it under NLTK_DATA).")
    return None


def similarity(metric: str, text: str, reference: str) -> float:
    """``metric`` of ``text`` against ``reference``, in [0, 1]."""
    return METRICS[metric](text, reference)
