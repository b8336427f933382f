"""Kubernetes deployment of Tessera: Helm values, KubeRay manifest, per-step pod resources.

Importable data (`deploy.k8s_tags`) and the step executor (`deploy.k8s_executor`) live here so
production definitions and the offline manifest tests read one source."""
