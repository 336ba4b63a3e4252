"""The instances an operator sizes for: GPUs, memory per GPU and host memory, with sources."""

from __future__ import annotations

from dataclasses import dataclass

GiB, GB = 1024**3, 10**9


@dataclass(frozen=True)
class Instance:
    gpus: int
    gpu_memory_bytes: int  # per GPU
    host_memory_bytes: int
    source: str


_BATCH_GPU_TABLE = "AWS Batch User Guide, 'Run GPU jobs', instance table"
# SageMaker's ml.<type> runs on the EC2 instance of the same name. Figures as the source states
# them (GiB where it says GiB, GB where it says GB); the engine itself sizes from the memory
# the driver reports free after loading, which is somewhat less.
INSTANCES: dict[str, Instance] = {
    "ml.g5.xlarge": Instance(1, 24 * GiB, 16 * GiB, _BATCH_GPU_TABLE),
    "ml.g5.2xlarge": Instance(1, 24 * GiB, 32 * GiB, _BATCH_GPU_TABLE),
    "ml.g5.12xlarge": Instance(4, 24 * GiB, 192 * GiB, _BATCH_GPU_TABLE),
    "ml.g6.xlarge": Instance(1, 24 * GiB, 16 * GiB, _BATCH_GPU_TABLE),
    "ml.g6.2xlarge": Instance(1, 24 * GiB, 32 * GiB, _BATCH_GPU_TABLE),
    "ml.g6e.xlarge": Instance(
        1,
        48 * GB,
        32 * GiB,
        "NVIDIA L40S datasheet (48 GB GDDR6); host: 4 vCPU, 32 GiB "
        "(torchx named_resources_aws aws_g6e_xlarge; deploybase.ai 'L40S on AWS')",
    ),
    "ml.p4d.24xlarge": Instance(
        8,
        40 * GB,
        int(1.1 * 10**12),
        "AWS HPC blog 'Amazon EC2 P4d instances deep dive': 8 x 40 GB A100, 1.1 TB RAM",
    ),
}
