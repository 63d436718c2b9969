"""Engine pieces: the accept step (greedy and rejection sampling), drafters (noisy copy,
prompt lookup, early-exit self-draft), the reference speculative-decoding loop."""

from .accept import (AcceptResult, PhiloxNoise, PreDrawnNoise, SamplingParams, accept,
                     accept_reference, draw_philox_noise, emitted_tokens, philox4x32)
from .drafter import Drafter, Drafts, NoisyCopyDrafter
from .early_exit import EarlyExitDrafter, early_exit_model
from .hook import DSparkHook, VerifyHook
from .lookup import PromptLookupDrafter
from .loop import MODES, EngineConfig, ReferenceEngine, StepReport

__all__ = ["AcceptResult", "PhiloxNoise", "PreDrawnNoise", "SamplingParams", "accept",
           "accept_reference", "draw_philox_noise", "emitted_tokens", "philox4x32",
           "Drafter", "Drafts", "NoisyCopyDrafter", "MODES", "EngineConfig", "ReferenceEngine",
           "StepReport", "DSparkHook", "VerifyHook", "PromptLookupDrafter", "EarlyExitDrafter",
           "early_exit_model"]
