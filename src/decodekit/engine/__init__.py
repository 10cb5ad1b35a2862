"""The engine loop and the method registry."""

from .api import Engine, generate, make_sampler, prompt_token_ids, split_params
from .core import (
    DecodeState,
    Decoder,
    Generation,
    GenerationStats,
    PlainDecoding,
    Request,
    StepDecoder,
    StepMethod,
    check_fits,
)
from .registry import (MethodSpec, available_methods, build_decoder, check_model_cache, method_spec, register_method,
                       sequences_at_once, validate_options)
from .stops import cut_at_stop, hits_stop, stop_strings

__all__ = [
    "DecodeState", "Decoder", "Engine", "Generation", "GenerationStats", "MethodSpec", "PlainDecoding", "Request",
    "StepDecoder", "StepMethod", "available_methods", "build_decoder", "check_fits", "check_model_cache", "cut_at_stop",
    "generate", "hits_stop", "make_sampler", "method_spec", "prompt_token_ids", "register_method", "split_params",
    "sequences_at_once", "stop_strings", "validate_options",
]
