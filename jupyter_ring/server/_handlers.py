"""Tornado handlers for the Ring panel (every one authenticated; actions are POST + XSRF/token)."""

import json
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from ..errors import ClusterNotFound, JupyterRingError
from ._clusters import (CLUSTER_ID_RE, Session, attach_cluster, describe_cluster, find_cluster_file,
                        interrupt_cluster, kernel_pids, kernel_sessions, list_clusters, stop_cluster,
                        where_cluster)

__all__ = ["setup_handlers"]

NAMESPACE = "jupyter-ring"


class _RingHandler(APIHandler):
    def _kernels(self) -> dict[int, str]:
        return kernel_pids(self.settings.get("kernel_manager"))

    async def _sessions(self) -> dict[str, Session]:
        return await kernel_sessions(self.settings.get("session_manager"))

    def _path(self, cluster_id: str) -> str:
        try:
            return find_cluster_file(cluster_id)
        except ClusterNotFound as exc:
            raise tornado.web.HTTPError(404, str(exc)) from exc


class ClustersHandler(_RingHandler):
    """``GET /jupyter-ring/clusters`` -> ``{"clusters": [...]}``."""

    @tornado.web.authenticated
    async def get(self) -> None:
        clusters = list_clusters(self._kernels(), sessions=await self._sessions())
        self.finish(json.dumps({"clusters": clusters}))


class ClusterHandler(_RingHandler):
    """``GET /jupyter-ring/clusters/<id>`` -> one cluster's description."""

    @tornado.web.authenticated
    async def get(self, cluster_id: str) -> None:
        path = self._path(cluster_id)
        sessions = await self._sessions()
        try:
            info = describe_cluster(path, self._kernels(), sessions)
        except FileNotFoundError as exc:  # stopped between the lookup and the read
            raise tornado.web.HTTPError(404, f"cluster {cluster_id!r} has stopped") from exc
        self.finish(json.dumps(info))


class ClusterActionHandler(_RingHandler):
    """``POST /jupyter-ring/clusters/<id>/(interrupt|stop|where|attach)``."""

    @tornado.web.authenticated
    async def post(self, cluster_id: str, action: str) -> None:
        path = self._path(cluster_id)
        try:
            if action == "interrupt":
                result = await interrupt_cluster(path)
            elif action == "where":
                result = await where_cluster(path)
            elif action == "attach":
                result = await attach_cluster(path)
            else:
                result = await stop_cluster(path)
        except ClusterNotFound as exc:
            raise tornado.web.HTTPError(404, f"cluster {cluster_id!r}: {exc}") from exc
        except JupyterRingError as exc:  # the cluster cannot do it now (no engines, no controller)
            raise tornado.web.HTTPError(409, f"cluster {cluster_id!r}: {exc}") from exc
        self.log.info("jupyter_ring: %s cluster %s", action, cluster_id)
        self.finish(json.dumps({"id": cluster_id, "action": action, **result}))


def setup_handlers(web_app: Any) -> None:
    """Add the routes under the server's base URL."""
    base = url_path_join(web_app.settings.get("base_url", "/"), NAMESPACE, "clusters")
    web_app.add_handlers(".*$", [
        (base, ClustersHandler),
        (url_path_join(base, f"({CLUSTER_ID_RE})"), ClusterHandler),
        (url_path_join(base, f"({CLUSTER_ID_RE})", "(interrupt|stop|where|attach)"),
         ClusterActionHandler),
    ])
