"""In-process fake Kubernetes API server for what natgw-agent asks of the API.

No API server can run on the test machines, so this speaks the part of the real wire protocol
the agent uses (JSON over HTTP/1.1 or HTTPS, chunked watch streams, Status errors, one global
resourceVersion, BOOKMARKs, ERROR 410 after compaction, paginated lists) for the official
``kubernetes`` client to talk to it unchanged. Standard library only, so it can also run inside
a network namespace.

Served (group/version/resource: verbs):
  kubeovn.io/v1 iptables-dnat-rules, iptables-eips   cluster-scoped: list (limit/continue), watch
  v1 events                                          namespaced: create
  apiextensions.k8s.io/v1 customresourcedefinitions  get: iptables-dnat-rules' from the start
                                                     (``crds``), others registered with set_crd()
Any other verb on these is 405, any other path 404; every request is logged (``requests``)
as the RBAC authorizer sees it.

Differences from a real API server, on purpose: no auth, admission, schema, finalizers or
discovery; no selectors; lists only at the latest version (no resourceVersion parameter) and
watches only from a given one (a list's); objects set by tests are stored as given, status
included, and updates are not checked against their resourceVersion.

Modules: ``protocol`` (resources, Status errors, request attributes, continue tokens),
``store`` (objects, versions, history, compaction, watches), ``server`` (the HTTP handler),
``listener`` (the socket, outages, TLS), ``tls`` (certificates for it), ``crds`` (the CRD it
serves), ``fake`` (FakeKube: all together, and what tests drive).
"""
from .fake import FakeKube
from .protocol import Request

__all__ = ["FakeKube", "Request"]
