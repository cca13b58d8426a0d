"""ZeRO data parallelism and mixed precision: flat buckets, sharded optimizer, loss scaling.

Entry point: `build_optimizer(model_or_chunks, topo, OptimizerConfig(...))`; see `optimizer.py`.
"""
from .config import LossScaleConfig, OptimizerConfig, ZeroConfigError
from .optimizer import NonFiniteError, StepResult, ZeroOptimizer, build_optimizer

__all__ = ["LossScaleConfig", "NonFiniteError", "OptimizerConfig", "StepResult",
           "ZeroConfigError", "ZeroOptimizer", "build_optimizer"]
