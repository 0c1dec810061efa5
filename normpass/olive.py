"""normpass as an Olive pass (the `olive` extra): `NormpassFold` runs `fold_onnx` in an Olive workflow.

Olive finds a pass type through its package configuration (`olive/olive_config.json`: pass name →
`module_path`), which `olive.workflows.run(config, package_config=...)` and `olive run
--package-config FILE` let the caller replace. `package_config()` is Olive's own configuration
with `NormpassFold` added, so a workflow can use it beside Olive's passes::

    from olive.workflows import run
    from normpass.olive import package_config

    run({"input_model": {"type": "ONNXModel", "model_path": "model.onnx"},
         "passes": {"fold": {"type": "NormpassFold"},
                    "optimize": {"type": "OrtTransformersOptimization", "model_type": "gpt2"}},
         "output_dir": "out"},
        package_config=package_config())

The emission follows the workflow's execution provider: `SimplifiedLayerNormalization` tuned for
the CPU or for CUDA (`FoldOptions.provider`) where ONNX Runtime's contrib ops run (CPU, CUDA,
TensorRT, ROCm), standard ops only (`target="onnx"`) for any other provider; the pass's `target`
and `provider` parameters override that. A fold that fails verification raises
`VerificationError` out of the workflow (Olive re-raises a pass's error unless it is searching).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import missing_extra
from .io import unmapped
from .onnx.fold.driver import PROVIDERS, TARGETS, FoldOptions, fold_onnx

try:
    from olive.hardware.accelerator import AcceleratorSpec
    from olive.hardware.constants import ExecutionProvider
    from olive.model import ONNXModelHandler
    from olive.model.utils import resolve_onnx_path
    from olive.package_config import OlivePackageConfig
    from olive.passes import Pass
    from olive.passes.onnx.common import get_external_data_config, ir_model_to_olive_model
    from olive.passes.pass_config import BasePassConfig, PassConfigParam
except ModuleNotFoundError as e:
    if not (e.name or "").startswith("olive"):
        raise
    raise missing_extra("normpass.olive", "Olive", "olive") from None

# Providers that run ONNX Runtime's contrib ops (SimplifiedLayerNormalization and its Skip fusion).
CONTRIB_PROVIDERS = {
    ExecutionProvider.CPUExecutionProvider: "cpu",
    ExecutionProvider.CUDAExecutionProvider: "cuda",
    ExecutionProvider.TensorrtExecutionProvider: "cuda",
    ExecutionProvider.ROCMExecutionProvider: "cuda",
}


class NormpassFold(Pass):
    """Fold every provable LayerNorm of an ONNX model into an RMSNorm, verified (`normpass.fold_onnx`)."""

    @classmethod
    def _default_config(cls, accelerator_spec: AcceleratorSpec) -> dict[str, PassConfigParam]:
        return {
            "target": PassConfigParam(
                type_=str,
                default_value=None,
                description=f"one of {', '.join(TARGETS)}; default: ort for the CPU, CUDA, TensorRT and ROCm "
                "providers, onnx (standard ops only) for others",
            ),
            "provider": PassConfigParam(
                type_=str,
                default_value=None,
                description=f"one of {', '.join(PROVIDERS)}: the emission's tuning; default: from the workflow's "
                "execution provider (cpu for the CPU provider, cuda otherwise)",
            ),
            "rms_op": PassConfigParam(
                type_=str, default_value=None, description="simplified, onnx or decomposed; default: the target's"
            ),
            "fold_with_beta_add": PassConfigParam(
                type_=bool,
                default_value=False,
                description="also fold norms whose β would stay a separate Add (costs more than the LayerNorm)",
            ),
            "migrate_affine": PassConfigParam(
                type_=bool, default_value=True, description="move γ and β into the consuming linear layers"
            ),
            "insert_centering": PassConfigParam(
                type_=bool, default_value=True, description="insert an explicit x − mean(x) where it enables folds"
            ),
            "verify": PassConfigParam(
                type_=bool, default_value=True, description="compare the folded model with the original in ORT"
            ),
            **get_external_data_config(),
        }

    @staticmethod
    def is_accelerator_agnostic(accelerator_spec: AcceleratorSpec) -> bool:
        return False  # the emission depends on the execution provider

    def _run_for_config(
        self, model: ONNXModelHandler, config: type[BasePassConfig], output_model_path: str
    ) -> ONNXModelHandler:
        settings: Any = config  # Olive passes the validated config as an instance of this class
        default_provider = CONTRIB_PROVIDERS.get(self.accelerator_spec.execution_provider)
        options = FoldOptions(
            target=settings.target or ("ort" if default_provider else "onnx"),
            provider=settings.provider or default_provider or "cuda",
            rms_op=settings.rms_op,
            fold_with_beta_add=settings.fold_with_beta_add,
            migrate_affine=settings.migrate_affine,
            insert_centering=settings.insert_centering,
            verify=settings.verify,
        )
        result = fold_onnx(model.model_path, options, name=str(model.model_path))
        output_path = resolve_onnx_path(output_model_path, Path(model.model_path).name)
        return ir_model_to_olive_model(unmapped(result.ir_model), output_path, config)


def package_config() -> dict:
    """Olive's default package configuration with `NormpassFold` added (for `package_config=` or `--package-config`)."""
    with open(OlivePackageConfig.get_default_config_path(), encoding="utf-8") as f:
        config = json.load(f)
    config["passes"]["NormpassFold"] = {
        "module_path": f"{__name__}.NormpassFold",
        "supported_providers": ["*"],
        "supported_accelerators": ["*"],
        "supported_precisions": ["*"],
        "supported_algorithms": [],
        "supported_quantization_encodings": [],
    }
    return config
