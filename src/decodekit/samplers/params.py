"""The sampler's parameters, declared once: ``Sampler.from_params`` takes them, each processor
checks its value with its row, and the command line makes one flag per row (but ``greedy``,
which is spelled ``--method greedy``)."""

from __future__ import annotations

from ..options import OptionSpec, option_table

#: Seeds are 64-bit: torch's generator takes no more, and seed + i (a request's i-th sample, a
#: search's i-th row) wraps around at this limit.
SEED_LIMIT = 2**64

#: The logits are float32: a penalty past its range would make them infinite where no token was
#: seen (infinity times a count of 0), so penalties stay within it.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32

SAMPLER_OPTIONS: dict[str, OptionSpec] = option_table(
    OptionSpec("temperature", float, 1.0, "softmax temperature; 0 is greedy", lo=0.0),
    OptionSpec("top_k", int, None, "keep the k most likely tokens", lo=1),
    OptionSpec("top_p", float, None, "nucleus: the most likely tokens up to mass p", lo=0.0, hi=1.0, lo_open=True),
    OptionSpec("min_p", float, None, "keep tokens with p >= min_p * p_max", lo=0.0, hi=1.0),
    OptionSpec("typical_p", float, None, "locally typical sampling: typical tokens up to mass p", lo=0.0, hi=1.0, lo_open=True),
    OptionSpec("epsilon", float, None, "keep tokens with p >= epsilon", lo=0.0, hi=1.0, lo_open=True, hi_open=True),
    OptionSpec("eta", float, None, "eta sampling: an entropy-dependent cutoff", lo=0.0, hi=1.0, lo_open=True, hi_open=True),
    OptionSpec("top_n_sigma", float, None, "keep logits within n standard deviations of the max", lo=0.0, lo_open=True),
    OptionSpec("top_h", float, None, "top-H: keep a prefix with entropy <= top_h * H(p)", lo=0.0, hi=1.0, lo_open=True),
    OptionSpec("adaptive_k", float, None, "adaptive top-k: the KL decoder's per-token cost", lo=0.0, lo_open=True),
    OptionSpec("repetition_penalty", float, None, "divide (multiply) positive (negative) logits of seen tokens",
               lo=FLOAT32_TINY, hi=FLOAT32_MAX),
    OptionSpec("frequency_penalty", float, None, "subtract penalty * count of each seen token", lo=-FLOAT32_MAX, hi=FLOAT32_MAX),
    OptionSpec("presence_penalty", float, None, "subtract penalty from each seen token", lo=-FLOAT32_MAX, hi=FLOAT32_MAX),
    OptionSpec("penalty_window", int, None, "only the last N tokens count for the penalties", lo=1, hi=1 << 40),
    OptionSpec("no_repeat_ngram_size", int, None, "ban tokens that would repeat an n-gram", lo=1),
    OptionSpec("greedy", bool, False, "pick the most likely token instead of sampling"),
    OptionSpec("seed", int, None, "random seed (default: fresh entropy)", lo=0, hi=SEED_LIMIT - 1),
)

#: Keyword names of ``Sampler.from_params``, in order.
SAMPLER_PARAMS: tuple[str, ...] = tuple(SAMPLER_OPTIONS)
