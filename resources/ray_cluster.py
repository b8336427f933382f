"""Ray clusters for training, behind dagster-ray's `RayResource` interface.

- `LocalRayCluster`: in-process local Ray (default; tests share one Ray per session).
- `ExternalRayCluster`: a running cluster (`ray start --head`), by address.
- Production on Kubernetes: dagster-ray's `KubeRayCluster` (see deploy/ and README "Scaling out").
"""


import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dagster_ray import Lifecycle, LocalRay, RayResource
from dagster_ray.configs import RayDataExecutionOptions
from pydantic import Field, PrivateAttr, field_validator

from resources.reachability import connection_refusal
from training_core.train.ray_trainer import use_cluster_services, use_pooled_worker_processes, use_preemption_watcher


class RayDataOptions(RayDataExecutionOptions):
    """dagster-ray's Ray Data execution options, applied on connect only when asked for.

    dagster-ray applies them on every connect: in the driver, and through a remote task in one Ray
    worker, both importing `ray.data`. On two cores that added 6–9 s to each training run's
    connect (docs/training_benchmark.md). Tessera's training reads no Ray Dataset (its loader is the
    row-group reader), so by default nothing is applied."""

    apply_on_connect: bool = Field(
        default=False,
        description="apply these options on connect (driver and one worker), for code of your own "
                    "that uses Ray Data on this cluster; Tessera's training does not",
    )

    def apply(self) -> None:
        if self.apply_on_connect:
            super().apply()

    def apply_remote(self) -> None:
        if self.apply_on_connect:
            super().apply_remote()


# Declared with the narrower type on each resource: Dagster rebuilds a resource from its config,
# and a field typed as dagster-ray's class would come back as that class.
def ray_data_options_field() -> Any:
    return Field(default_factory=RayDataOptions, description=RayDataOptions.__doc__.splitlines()[0])


@dataclass(frozen=True)
class ClusterCeiling:
    """The Ray nodes a cluster has at its largest (a KubeRay worker group at ``maxReplicas``), and
    where that limit is set, for messages."""

    nodes: tuple[Mapping[str, float], ...]
    where: str


class _SharesRunningRay:
    """If this process already runs Ray (a test session, the CLI), use it and leave it running."""

    _owns_ray: bool = PrivateAttr(default=True)

    def connect(self, context):  # type: ignore[override]
        import ray

        if ray.is_initialized():
            self._owns_ray = False
            return None
        self._owns_ray = True
        return super().connect(context)  # type: ignore[misc]

    def cleanup(self, context, exception):  # type: ignore[override]
        if self._owns_ray:
            super().cleanup(context, exception)  # type: ignore[misc]


class LocalRayCluster(_SharesRunningRay, LocalRay):
    """In-process Ray on this machine, started when training starts (not for a reused run)."""

    lifecycle: Lifecycle = Field(default_factory=lambda: Lifecycle(connect=False),
                                 description="connect lazily: the training asset connects when it trains")

    ray_init_options: dict[str, Any] = Field(
        default_factory=lambda: {"logging_level": "warning"},
        description="extra ray.init() arguments, e.g. {'num_cpus': 2}",
    )

    preemption_watcher: bool = Field(
        default=False,
        description="run Ray Train's preemption watcher; a one-node local cluster is never drained",
    )

    cluster_services: bool = Field(
        default=False,
        description="use Ray Train's placement-group cleaner and autoscaling-coordinator actors; "
                    "a local one-node Ray has no autoscaler and ends with the run's process",
    )

    data_execution_options: RayDataOptions = ray_data_options_field()

    pooled_worker_processes: bool = Field(
        default=True,
        description="run Ray Train's controller and workers in Ray's already started worker processes "
                    "instead of a fresh process per actor (seconds sooner per training run)",
    )

    @property
    def ray_address(self) -> str:  # type: ignore[override]
        # "local" starts a fresh Ray in this process. dagster-ray's None would join whatever RAY_ADDRESS
        # or a `ray start` on this machine points at, with none of ExternalRayCluster's checks.
        return "local"

    @property
    def autoscaling(self) -> bool:
        return False  # one machine: what it has now is all it will ever have

    def connect(self, context):  # type: ignore[override]
        use_preemption_watcher(self.preemption_watcher)
        use_cluster_services(self.cluster_services)
        use_pooled_worker_processes(self.pooled_worker_processes)
        return super().connect(context)


RAY_ADDRESS_FORMS = ("Ray connects to the head node's GCS address HOST:6379 or its Ray Client address "
                     "ray://HOST:10001, not to the dashboard / Jobs API URL that `ray job submit` takes (port 8265)")


class ExternalRayCluster(_SharesRunningRay, RayResource):
    """A Ray cluster that is already running, reached by its GCS address (e.g. 127.0.0.1:6379)."""

    lifecycle: Lifecycle = Field(default_factory=lambda: Lifecycle(connect=False),
                                 description="connect lazily: the training asset connects when it trains")

    address: str = Field(description="GCS address of the head node, e.g. 10.0.0.5:6379 or 'auto'")

    autoscaling: bool = Field(
        False, description="the cluster adds nodes on demand: a training run larger than it is now waits "
                           "for them instead of failing at once",
    )

    connect_timeout_s: float = Field(
        30.0, gt=0,
        description="how long to wait for the head node to accept connections, and then for enough nodes "
                    "to have joined for the worker group, before the step fails (a wrong address otherwise "
                    "hangs in ray.init for minutes)",
    )

    @field_validator("address")
    @classmethod
    def _host_and_port(cls, value: str) -> str:
        """'auto', HOST:PORT or ray://HOST:PORT (from TESSERA_RAY_ADDRESS in local definitions)."""
        scheme, has_scheme, _ = value.partition("://")
        if has_scheme and scheme != "ray":  # http://HOST:8265 would fail only at DNS, after connect_timeout_s
            raise ValueError(f"Ray address {value!r} (TESSERA_RAY_ADDRESS or ray_cluster.address) is a URL "
                             f"({scheme}://); {RAY_ADDRESS_FORMS}")
        host, _, port = value.removeprefix("ray://").rpartition(":")
        if value != "auto" and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"Ray address {value!r} (TESSERA_RAY_ADDRESS or ray_cluster.address): "
                             "expected HOST:PORT, ray://HOST:PORT or 'auto'")
        return value

    data_execution_options: RayDataOptions = ray_data_options_field()

    def connect(self, context):  # type: ignore[override]
        import ray

        if not ray.is_initialized():
            wait_until_reachable(self.address, self.connect_timeout_s)
            refuse_if_the_token_is_refused(self.address)
        try:
            return super().connect(context)
        except (ConnectionError, RuntimeError) as error:
            if refused_for_its_token(error):
                raise RayClusterUnreachable(_token_refusal(self.address)) from error
            raise

    @property
    def capacity_ceiling(self) -> ClusterCeiling | None:
        """The largest size of deploy/kuberay/raycluster.yaml's RayCluster when the address is its
        head service (as docs/scaling_out.md points `tessera reproduce` at it), else unknown."""
        from resources.kuberay_cluster import attached_raycluster_ceiling  # it builds on this module

        return attached_raycluster_ceiling(self.address)

    @property
    def host(self) -> str:
        """The head node's host as the address names it (``[::1]`` keeps its brackets, so
        dagster-ray's ``dashboard_url`` stays a valid URL)."""
        if self.address == "auto":
            return "127.0.0.1"  # 'auto' names no host: usually a `ray start` cluster on this machine
        return self.address.removeprefix("ray://").rpartition(":")[0]

    @property
    def name(self) -> str:
        return f"ray-cluster@{self.address}"

    @property
    def ray_address(self) -> str:  # type: ignore[override]
        return self.address

    @property
    def created(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return True


def connect_to_cluster(ray_cluster: RayResource, context) -> None:
    """Create (if needed), wait for and connect to ``ray_cluster``: the steps dagster-ray runs at
    resource set-up when the ``Lifecycle`` flags are on (its private ``_connect``, spelled with the
    public methods and hooks). Tessera's clusters turn them off, so a
    step that reuses an earlier training run starts, creates and connects to nothing; the training
    asset calls this only when it trains, the evaluation asset only when it evaluates on the cluster. ``created``/``ready`` are already true for local and
    external clusters, so for them this is only ``connect``."""
    if not ray_cluster.created:
        ray_cluster.create(context)
        ray_cluster.on_create(context)
    if not ray_cluster.ready:
        ray_cluster.wait(context)
        ray_cluster.on_ready(context)
    ray_cluster.connect(context)
    if ray_cluster.connected:  # not when an already running in-process Ray was reused
        ray_cluster.on_connect(context)


def connect_unless_connected(ray_cluster: RayResource, context) -> None:
    """``connect_to_cluster`` unless this process is already connected (an earlier step of the same
    run, with the in-process executor, trained or evaluated on the cluster)."""
    import ray

    if not ray.is_initialized():
        connect_to_cluster(ray_cluster, context)


class RayClusterUnreachable(RuntimeError):
    """No Ray cluster answers at the configured Ray address: nothing accepts a connection there, or
    what does is an HTTP server (such as the Ray dashboard) or a peer that never answers, not Ray."""


# What ray.init's gRPC channel sends first: a peer that speaks HTTP/2, as Ray's GCS and Ray Client servers
# do, or a proxy in front of one, answers with an HTTP/2 SETTINGS frame.
GRPC_CONNECTION_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Asked only of a peer that did not answer in HTTP/2: some HTTP/1 servers (Python's http.server) answer
# the preface without a status line.
HTTP1_REQUEST = b"GET / HTTP/1.0\r\n\r\n"
HTTP2_SETTINGS_FRAME = 0x04
PROTOCOL_CHECK_TIMEOUT_S = 2.0


def refused_for_its_token(error: BaseException) -> bool:
    """Whether ``ray.init`` failed because the cluster wants an authentication token this process did
    not send. Ray's ``ConnectionError`` names only the address: the ``AuthenticationError`` behind it
    is an exception in the chain, or only text in the message of the ``RuntimeError`` it chains
    (Ray 2.60 keeps the last GCS attempt's traceback as a string)."""
    from ray.exceptions import AuthenticationError

    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, AuthenticationError) or "InvalidAuthToken" in str(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def refuse_if_the_token_is_refused(address: str) -> None:
    """Raise `RayClusterUnreachable` naming the token when the cluster's GCS refuses this process's
    (missing or wrong) token. ``ray.init`` retries that refusal once a second for ~20 s before its
    ConnectionError; one GCS client, as ``ray.init`` builds, answers in about a second. Anything else
    the client meets is left to ``ray.init``, which reports it as before (a Ray Client address, or
    'auto' with no local cluster to resolve, is not checked here)."""
    try:  # private to Ray: a Ray without them leaves the refusal to ray.init, as before
        from ray._private.services import canonicalize_bootstrap_address
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:
        return
    if address.startswith("ray://"):
        return
    try:
        gcs_address = canonicalize_bootstrap_address(address, None)  # 'auto': this machine's `ray start` cluster
        if gcs_address:
            GcsClient(address=gcs_address)
    except AuthenticationError as error:
        raise RayClusterUnreachable(_token_refusal(address)) from error
    except Exception:  # noqa: BLE001 - not a token refusal: ray.init connects, or says why it cannot
        return


def _token_refusal(address: str) -> str:
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    if auth_mode == "token":
        sent = "it has RAY_AUTH_MODE=token, but its token is missing or not the cluster's"
    else:
        sent = f"RAY_AUTH_MODE is {'not set' if auth_mode is None else repr(auth_mode)} here: it sent no token"
    return (f"Ray cluster at {address} (TESSERA_RAY_ADDRESS or ray_cluster.address) uses token authentication "
            f"(Ray 2.60's `ray start --head` turns it on) and refused this process ({sent}). Set RAY_AUTH_MODE=token "
            "for this process, with the cluster's token in ~/.ray/auth_token (where `ray start` keeps it), in a file "
            "named by RAY_AUTH_TOKEN_PATH, or in RAY_AUTH_TOKEN; every node needs the same")


def wait_until_reachable(address: str, timeout_s: float) -> None:
    """Return once something accepts TCP connections at ``address`` (HOST:PORT or ray://HOST:PORT),
    waiting up to ``timeout_s`` (a head node may still be starting), and it is not an HTTP/1 server
    nor a peer that stays silent; else raise naming the address. ``ray.init`` on a dead address, on the
    dashboard's port, or on a port whose service waits for its client to speak first (Postgres, a
    port-forward with nothing behind it) retries for minutes, and dagster-ray retries it for two more,
    so a typo in TESSERA_RAY_ADDRESS used to hang the step instead of failing it. Where Ray dials
    another host than the address names (127.0.0.1 becomes the node IP), that host is checked too."""
    if address == "auto":
        return
    deadline = time.monotonic() + timeout_s
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    _check_peer(address, host, int(port), timeout_s, deadline, rewritten="")
    # A Ray Client (ray://) dials the host as written; a GCS address Ray first rewrites.
    if not address.startswith("ray://") and (dialed := host_ray_dials(host)) != host:
        _check_peer(address, dialed, int(port), timeout_s, deadline,
                    rewritten=f" (Ray dials {dialed}:{port}, this machine's node IP, for {host})")


def _check_peer(address: str, host: str, port: int, timeout_s: float, deadline: float, rewritten: str) -> None:
    """``wait_until_reachable`` for one host, within what is left until ``deadline`` (at least a moment)."""
    def left_s() -> float:
        return max(deadline - time.monotonic(), min(timeout_s, PROTOCOL_CHECK_TIMEOUT_S))

    if error := connection_refusal(host, port, left_s()):
        raise RayClusterUnreachable(
            f"Ray cluster at {address} (TESSERA_RAY_ADDRESS or ray_cluster.address) did not accept a "
            f"connection within {timeout_s:g} s: {error}{rewritten}. Start it (`ray start --head --port={port}`), fix "
            "the address, or unset TESSERA_RAY_ADDRESS to train on in-process Ray"
        ) from error
    answer = answer_to_grpc_preface(host, port, left_s())
    if answer.http1_status_line:
        raise RayClusterUnreachable(
            f"Ray address {address} (TESSERA_RAY_ADDRESS or ray_cluster.address): port {port}{rewritten} is an HTTP "
            f"server (it answered {answer.http1_status_line!r}), not Ray; {RAY_ADDRESS_FORMS}")
    if answer.silent:
        server = "Ray Client server" if address.startswith("ray://") else "GCS"
        raise RayClusterUnreachable(
            f"Ray address {address} (TESSERA_RAY_ADDRESS or ray_cluster.address): port {port}{rewritten} accepted the "
            f"connection but did not answer as Ray's {server} (gRPC over HTTP/2) within {timeout_s:g} s "
            "(ray_cluster.connect_timeout_s): another service that waits for its client to speak first (a "
            "database, a port-forward or load balancer with nothing behind it) or a stuck head node. Fix the "
            f"address, or raise ray_cluster.connect_timeout_s for a head node that slow; {RAY_ADDRESS_FORMS}")


def host_ray_dials(host: str) -> str:
    """The host ``ray.init`` connects to for a GCS address on ``host``: Ray 2.60 replaces 127.0.0.1,
    localhost and ::1 with this machine's node IP, so a listener on the loopback interface only is not
    what Ray reaches. Ray's private helper (``ray._private.services``), kept to this one function; the
    host as written where it is gone."""
    try:
        from ray._private.services import resolve_ip_for_localhost
    except ImportError:
        return host
    try:
        return resolve_ip_for_localhost(host).strip("[]")
    except Exception:  # noqa: BLE001 - no node IP found: Ray's own connect will say so
        return host


@dataclass(frozen=True)
class PeerAnswer:
    """How the peer at a Ray address answered gRPC's connection preface (what ray.init sends first)."""

    silent: bool = False  # it accepted the connection, then sent nothing and kept it open
    http1_status_line: str | None = None


def answer_to_grpc_preface(host: str, port: int, timeout_s: float = PROTOCOL_CHECK_TIMEOUT_S) -> PeerAnswer:
    """Send gRPC's connection preface to ``host:port`` and wait up to ``timeout_s`` for the answer.
    Ray's GCS and Ray Client servers answer at once with an HTTP/2 SETTINGS frame, an HTTP/1 server with
    a status line (or with one to a plain GET), a TLS server with an alert or by closing; a peer that
    says nothing at all is no Ray."""
    requests = ((GRPC_CONNECTION_PREFACE, timeout_s), (HTTP1_REQUEST, min(timeout_s, PROTOCOL_CHECK_TIMEOUT_S)))
    for request, wait_s in requests:
        try:
            peer = socket.create_connection((host, port), timeout=min(wait_s, PROTOCOL_CHECK_TIMEOUT_S))
        except OSError:
            continue
        with peer:
            try:
                peer.settimeout(wait_s)
                peer.sendall(request)
                reply = peer.recv(64)
            except TimeoutError:  # an HTTP/1 server answers the preface at once, if only with an error
                return PeerAnswer(silent=request is GRPC_CONNECTION_PREFACE)
            except OSError:
                continue
        if reply.startswith(b"HTTP/"):
            return PeerAnswer(http1_status_line=reply.split(b"\r\n")[0].decode("ascii", errors="replace"))
        if len(reply) >= 9 and reply[3] == HTTP2_SETTINGS_FRAME:  # frame header: 3-byte length, then type
            return PeerAnswer()
    return PeerAnswer()



def check_cluster_capacity(training_config, ray_cluster: Any, log: Any, poll_s: float = 1.0) -> None:
    """Fail before Ray Train waits for ever for a worker group the connected cluster cannot hold;
    the one decision for the training asset and ``tessera reproduce``.

    A cluster whose largest size is known (``capacity_ceiling``: a KubeRay RayCluster's worker
    groups at ``maxReplicas``) refuses a group larger than that at once and waits for its autoscaler
    below it. Any other cluster that adds nodes on demand (``autoscaling``) only gets a warning: the
    nodes may come. An external cluster gets ``connect_timeout_s`` for nodes that are still joining
    (a cluster started moments ago); in-process Ray has all it will ever have at once."""
    from training_core.errors import ConfigError

    alive = alive_node_resources()
    if (shortfall := training_config.capacity_shortfall(alive)) is None:
        return
    if (ceiling := getattr(ray_cluster, "capacity_ceiling", None)) is not None:
        if _holds_more_than(alive, ceiling.nodes):
            # the manifest in the image is older than the RayCluster applied from an operator's checkout
            log.warning(f"{shortfall}; the cluster already holds more than {ceiling.where} at its largest (a "
                        "RayCluster applied since with more replicas?): waiting for its autoscaler")
            return
        if (never := training_config.capacity_shortfall(ceiling.nodes)) is not None:
            raise ConfigError(f"num_workers={training_config.num_workers} with use_gpu={training_config.use_gpu} "
                              f"can never run on {ceiling.where}, even at its largest: {never}")
        log.warning(f"{shortfall}; waiting for nodes to join: {ceiling.where} holds the worker group at its largest")
        return
    if getattr(ray_cluster, "autoscaling", True):
        log.warning(f"{shortfall}; waiting for the cluster's autoscaler to add nodes")
        return
    deadline = time.monotonic() + float(getattr(ray_cluster, "connect_timeout_s", 0.0))
    while time.monotonic() + poll_s <= deadline:
        time.sleep(poll_s)
        if (shortfall := training_config.capacity_shortfall(alive_node_resources())) is None:
            return
    raise ConfigError(shortfall)


def _holds_more_than(alive: Sequence[Mapping[str, float]], largest: Sequence[Mapping[str, float]]) -> bool:
    """Whether the live nodes exceed a cluster size in nodes, CPUs or GPUs: that size is not the cluster's largest."""
    def totals(nodes: Sequence[Mapping[str, float]]) -> tuple[float, float, float]:
        return len(nodes), sum(n.get("CPU", 0.0) for n in nodes), sum(n.get("GPU", 0.0) for n in nodes)

    return any(live > most for live, most in zip(totals(alive), totals(largest)))


def alive_node_resources() -> list[dict[str, float]]:
    """Each alive node's total resources (``CPU``, ``GPU``, ``memory``, …) on the connected cluster:
    a worker's resources must all be on one node, so cluster totals cannot say whether it fits."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node["Alive"]]


def gpu_available_in_cluster() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


__all__ = ["ClusterCeiling", "LocalRayCluster", "ExternalRayCluster", "RayClusterUnreachable", "RayDataOptions",
           "RayResource", "alive_node_resources", "check_cluster_capacity", "connect_to_cluster",
           "connect_unless_connected", "gpu_available_in_cluster", "wait_until_reachable",
           "answer_to_grpc_preface", "host_ray_dials", "PeerAnswer"]
