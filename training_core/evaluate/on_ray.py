"""Run an evaluation as a task on the Ray cluster, where the GPUs are (no GPU in the step process)."""

from __future__ import annotations

from training_core.evaluate.compare import EvaluationJob, EvaluationOutcome, run_evaluation


def task_resources(device: str, cluster_has_gpu: bool) -> dict[str, float]:
    """What the task asks Ray for: one GPU for ``cuda``, and for ``auto`` when the cluster has one."""
    wants_gpu = device == "cuda" or (device == "auto" and cluster_has_gpu)
    return {"num_cpus": 1, "num_gpus": 1 if wants_gpu else 0}


def evaluate_on_ray(job: EvaluationJob, cluster_has_gpu: bool) -> EvaluationOutcome:
    """Blocks until the task ends; its error (a damaged model folder, …) is raised here as the same class.
    Not retried: an evaluation that failed once fails the same way again."""
    import ray

    resources = task_resources(job.settings.device, cluster_has_gpu)
    if resources["num_gpus"] and not cluster_has_gpu:
        from training_core.errors import ConfigError

        raise ConfigError("evaluation device='cuda' with on_ray_cluster=True, but the Ray cluster has no GPU; "
                          "use device='auto' or 'cpu'")
    task = ray.remote(max_retries=0, **resources)(run_evaluation)
    return ray.get(task.remote(job))
