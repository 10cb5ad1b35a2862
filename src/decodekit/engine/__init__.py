"""The engine loop and the method registry."""

from .api import Engine, generate, make_sampler, split_params
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
    finish_text,
)
from .registry import available_methods, build_decoder, method_spec, register_method

__all__ = [
    "DecodeState", "Decoder", "Engine", "Generation", "GenerationStats", "PlainDecoding", "Request",
    "StepDecoder", "StepMethod", "available_methods", "build_decoder", "check_fits", "finish_text",
    "generate", "make_sampler", "method_spec", "register_method", "split_params",
]
