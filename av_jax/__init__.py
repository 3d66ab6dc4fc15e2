"""av_jax: Adaptive Verification for speculative decoding in JAX.

The public API, one name per line (see README.md and docs/).
"""

from av_jax import costs
from av_jax import metrics
from av_jax.arms import ARMS
from av_jax.arms import Arm
from av_jax.arms import parse_arm
from av_jax.decision import Decider
from av_jax.decision import Decision
from av_jax.decision import DecisionState
from av_jax.decision import decision_step
from av_jax.decision import make_decider
from av_jax.decision import make_decision
from av_jax.estimator import EstimatorConfig
from av_jax.estimator import EstimatorState
from av_jax.estimator import OnlineEstimator
from av_jax.estimator import online_estimator
from av_jax.features import FEATURE_CLIP
from av_jax.features import FEATURES
from av_jax.features import Feature
from av_jax.features import get_feature
from av_jax.features import logit_qmax
from av_jax.features import neg_entropy
from av_jax.features import top2_margin
from av_jax.decider import PolicyDecider
from av_jax.decider import make_policy_decider
from av_jax.planner import POLICIES
from av_jax.planner import Plan
from av_jax.planner import Planner
from av_jax.planner import PlannerConfig
from av_jax.planner import PlannerState
from av_jax.planner import exact_policy
from av_jax.planner import is_exact
from av_jax.planner import make_planner
from av_jax.policy import Policy
from av_jax.policy import PolicyState
from av_jax.policy import StepCost
from av_jax.policy import StepOutcome
from av_jax.policy import choose
from av_jax.policy import make_policy
from av_jax.profiling import check_cost_covers
from av_jax.profiling import profile_costs
from av_jax.sampling import Sampling
from av_jax.sampling import sampling_log_probs
from av_jax.rejection import LogprobsTensors
from av_jax.rejection import RejectionResult
from av_jax.rejection import rejection_sample
from av_jax.rejection import rejection_sample_ragged
from av_jax.selection import CostModel
from av_jax.selection import allocate
from av_jax.selection import choose_budget
from av_jax.selection import linear_cost_model
from av_jax.selection import make_cost_model
from av_jax.selection import survival

__version__ = "0.1.0"

__all__ = (
    "ARMS",
    "Arm",
    "CostModel",
    "Decider",
    "Decision",
    "DecisionState",
    "EstimatorConfig",
    "EstimatorState",
    "FEATURES",
    "FEATURE_CLIP",
    "Feature",
    "LogprobsTensors",
    "OnlineEstimator",
    "POLICIES",
    "Plan",
    "Planner",
    "PlannerConfig",
    "PlannerState",
    "RejectionResult",
    "Sampling",
    "allocate",
    "check_cost_covers",
    "choose_budget",
    "costs",
    "decision_step",
    "exact_policy",
    "get_feature",
    "is_exact",
    "linear_cost_model",
    "logit_qmax",
    "make_cost_model",
    "make_decider",
    "make_decision",
    "make_planner",
    "metrics",
    "neg_entropy",
    "online_estimator",
    "parse_arm",
    "profile_costs",
    "rejection_sample",
    "rejection_sample_ragged",
    "sampling_log_probs",
    "survival",
    "top2_margin",
    "PolicyDecider",
    "make_policy_decider",
    "Policy",
    "PolicyState",
    "StepCost",
    "StepOutcome",
    "choose",
    "make_policy",
)
