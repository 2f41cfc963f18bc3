"""The Jupyter server side of the Ring panel: REST routes over ipyparallel's cluster files.

Enabled by ``jupyter-config/jupyter_server_config.d/jupyter_ring.json`` (installed with the
package). Routes, all under the server's base URL and all requiring an authenticated user:

- ``GET  /jupyter-ring/clusters``                  every cluster, its ranks and owner
- ``GET  /jupyter-ring/clusters/<id>``             one cluster
- ``POST /jupyter-ring/clusters/<id>/interrupt``   SIGINT every rank (works while the kernel is busy)
- ``POST /jupyter-ring/clusters/<id>/stop``        stop engines and controller, kill leftovers

Importing this package imports neither tornado nor jupyter_server; the handlers load with the
extension.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

__all__ = ["_jupyter_server_extension_points", "_load_jupyter_server_extension"]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """The extension's module for jupyter_server's loader."""
    return [{"module": "jupyter_ring.server"}]


def _load_jupyter_server_extension(serverapp: "ServerApp") -> None:
    """Register the routes with the running Jupyter server."""
    from ._handlers import setup_handlers

    setup_handlers(serverapp.web_app)
    serverapp.log.info("jupyter_ring: Ring panel routes at %sjupyter-ring/",
                       serverapp.web_app.settings.get("base_url", "/"))
