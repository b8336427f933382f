"""Each Ray worker checks that it runs the code and libraries the run's lineage records.

The lineage (code_version, package versions, environment_digest) is computed in the driver: the
Dagster step, or whoever called `run_training`. The workers import their own copy of Tessera and
the libraries from the Ray node's environment, which need not be the driver's (a long-lived
KubeRay cluster left on the old image after the code location was upgraded, a `ray start` node
with another checkout or PYTHONPATH). Such a run would train other code under the recorded
versions, and be reused and resumed as if it were that code; each worker refuses it instead."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from training_core.errors import LineageError
from training_core.lineage import REPO_ROOT, code_version, environment_digest, package_versions, source_digest


@dataclass(frozen=True)
class CodeIdentity:
    """The code and tracked library versions one process runs, as the lineage records them.
    Compared by ``source_digest`` (the code files' content), not ``code_version``: git's view of the
    same files changes as they are staged or committed (a developer committing while a dirty-tree
    run trains would fail its next worker restart), and an image holds no .git."""

    code_version: str  # named in messages
    source_digest: str  # lineage.source_digest()
    package_versions: dict[str, str]  # lineage.package_versions(): {"version_torch": "2.5.1", ...}
    environment_digest: str

    @classmethod
    def of_this_process(cls) -> CodeIdentity:
        versions = package_versions()
        return cls(code_version(), source_digest(), versions, environment_digest(versions))

    @classmethod
    def from_lineage(cls, lineage: Mapping[str, str]) -> CodeIdentity:
        """What a lineage record (`lineage.build_lineage_record`) says the driver runs, with the
        driver's sources as they are now (the record was taken a moment ago)."""
        versions = {name: lineage[name] for name in package_versions() if name in lineage}
        return cls(lineage["code_version"], source_digest(), versions, lineage["environment_digest"])

    def as_dict(self) -> dict:
        return asdict(self)


def code_differences(recorded: CodeIdentity, running: CodeIdentity) -> list[str]:
    """How the code a worker runs differs from the recorded ("code: a, sources x (recorded) ≠ b,
    sources y (this worker)", one line per package version), [] when it does not. Compared by value,
    not by environment_digest: the line names what differs."""
    differences = []
    if recorded.source_digest != running.source_digest:
        differences.append(f"code: {recorded.code_version}, sources {recorded.source_digest} (recorded) ≠ "
                           f"{running.code_version}, sources {running.source_digest} (this worker)")
    was, now = recorded.package_versions, running.package_versions
    for name in sorted(was.keys() | now.keys()):
        if was.get(name) != now.get(name):
            differences.append(f"{name}: {was.get(name, 'not recorded')} (recorded) ≠ {now.get(name, 'not recorded')} "
                               "(this worker)")
    return differences


def refuse_other_code(recorded: CodeIdentity, rank: int, running: CodeIdentity | None = None) -> None:
    """Raise a LineageError when this worker runs other code or libraries than the recorded ones
    (`running`: this process's, computed when not given). A LineageError is not retried by Ray
    (repeatable_failures): every attempt would hit the same cluster."""
    running = running or CodeIdentity.of_this_process()
    if not (differences := code_differences(recorded, running)):
        return
    raise LineageError(
        f"training rank {rank} on {socket.gethostname()} (Tessera sources in {REPO_ROOT}) runs other code than the "
        f"driver recorded for this run: {'; '.join(differences)}; environment_digest {recorded.environment_digest} "
        f"(recorded) vs {running.environment_digest} (this worker). The Ray cluster runs other code than the Dagster "
        "code location that launched the run: redeploy or restart it with the code location's image (KubeRay: the "
        "image in raycluster.yaml; a `ray start` cluster: restart its nodes from the same checkout and environment), "
        "then relaunch."
    )
