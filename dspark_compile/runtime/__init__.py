"""DSpark runtime: decides how many tokens each request verifies.

- ``sps`` / ``sps_fit``: step-rate models (measured tables, additive fit) the decisions trade on.
- ``planner``: ragged verify lengths from draft confidence (host reference).
- ``width``: one uniform verify width per step from measured hazards.
- ``estimator``: conditional acceptance for drafts without a confidence head.
- ``calibration``: temperature scaling of a confidence head, online or static.
"""

from .calibration import CalibrationConfig, TemperatureCalibrator
from .estimator import AcceptanceEstimator, EstimatorConfig, draft_logit_qmax
from .planner import Planner, PlannerConfig, VerifyPlan, plan_lengths, plan_verify, survival
from .sps import (
    SPS_SCHEMA,
    SpsEntry,
    SpsMetadata,
    SpsSample,
    SpsTable,
    StepRateModel,
    TierRate,
    table_from_samples,
)
from .sps_fit import AdditiveStepModel, fit_additive_model
from .width import WidthPolicy, WidthPolicyConfig, expected_tokens

__all__ = [
    "AcceptanceEstimator",
    "AdditiveStepModel",
    "CalibrationConfig",
    "EstimatorConfig",
    "Planner",
    "PlannerConfig",
    "SPS_SCHEMA",
    "SpsEntry",
    "SpsMetadata",
    "SpsSample",
    "SpsTable",
    "StepRateModel",
    "TemperatureCalibrator",
    "TierRate",
    "VerifyPlan",
    "WidthPolicy",
    "WidthPolicyConfig",
    "draft_logit_qmax",
    "expected_tokens",
    "fit_additive_model",
    "plan_lengths",
    "plan_verify",
    "survival",
    "table_from_samples",
]
