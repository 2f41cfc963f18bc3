/**
 * jupyter-ring: a Ring panel in the left sidebar and a status-bar item for jupyter_ring clusters.
 * Interrupt, stop and where go through the server (jupyter_ring.server), so they work while the
 * kernel is busy; restart runs ``%ring restart`` in the kernel that owns the cluster. A cell cut
 * off by a kernel restart keeps its rank tabs as static output (./cutoff).
 */
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { clusterAction, whereCluster } from './api';
import { watchRestarts } from './cutoff';
import { showLiveView } from './livecell';
import { changesClusters, IClusterInfo } from './model';
import { RingPanel } from './panel';
import { ClusterPoller } from './poller';
import { ClusterAction, renderWhereReport } from './render';
import { RingStatus } from './status';

const ringSvg =
  '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">' +
  '<g class="jp-icon3" fill="#616161"><circle cx="12" cy="4" r="2.5"/><circle cx="20" cy="12" r="2.5"/>' +
  '<circle cx="12" cy="20" r="2.5"/><circle cx="4" cy="12" r="2.5"/>' +
  '<path d="M12 4a8 8 0 1 1 0 16a8 8 0 1 1 0-16m0 1.5a6.5 6.5 0 1 0 0 13a6.5 6.5 0 1 0 0-13z"/></g></svg>';

export const ringIcon = new LabIcon({ name: 'jupyter-ring:ring', svgstr: ringSvg });

/** Every rank's stack in a dialog (through the server: the owner kernel may be busy). */
async function showWhere(cluster: IClusterInfo): Promise<void> {
  let report;
  try {
    report = await whereCluster(cluster.id);
  } catch (err) {
    // the server's reason names the fix (404: the cluster stopped; 409: no rank table yet, ...)
    const error = new Error(`could not read the ranks' stacks: ${(err as Error).message}`);
    void showErrorMessage(`Where? ${cluster.id}`, error);
    throw error;
  }
  // not awaited: the action ends (the card's buttons are enabled again) when the report arrives
  void showDialog({
    title: `Where? cluster ${cluster.id}`,
    body: new Widget({ node: renderWhereReport(report) }),
    buttons: [Dialog.okButton({ label: 'Close' })]
  });
}

/** Run ``%ring restart`` in the kernel that owns the cluster (after interrupting its ranks). */
async function restartInKernel(app: JupyterFrontEnd, cluster: IClusterInfo): Promise<void> {
  const kernels = app.serviceManager.kernels;
  await kernels.refreshRunning();
  const model = Array.from(kernels.running()).find(k => k.id === cluster.owner.kernel_id);
  if (!model) {
    throw new Error('its kernel is not running in this JupyterLab');
  }
  // A busy kernel would queue the restart behind the running cell: end that cell first. A cluster
  // with no engines left refuses the interrupt (409); %ring restart replaces it all the same.
  try {
    await clusterAction(cluster.id, 'interrupt');
  } catch (err) {
    console.warn(`jupyter-ring: interrupt before restart of ${cluster.id} failed`, err);
  }
  const kernel = kernels.connectTo({ model });
  try {
    const future = kernel.requestExecute({ code: '%ring restart', silent: false, store_history: false });
    const reply = await future.done;
    if (reply.content.status !== 'ok') {
      const content = reply.content as any;
      throw new Error(`%ring restart failed: ${content.ename}: ${content.evalue}`);
    }
  } finally {
    kernel.dispose(); // closes this connection only; the kernel keeps running
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-ring:plugin',
  description: 'Ring panel and status item for jupyter_ring clusters.',
  autoStart: true,
  optional: [ILabShell, INotebookTracker, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell | null,
    tracker: INotebookTracker | null,
    statusBar: IStatusBar | null
  ) => {
    const poller = new ClusterPoller();

    const showLive = async (cluster: IClusterInfo): Promise<void> => {
      if (!tracker) {
        throw new Error('no notebooks in this JupyterLab');
      }
      try {
        await showLiveView(
          cluster,
          tracker,
          async path => (await app.commands.execute('docmanager:open', { path, factory: 'Notebook' })) as any,
          panel => app.shell.activateById(panel.id)
        );
      } catch (err) {
        void showErrorMessage(`Show live view: ${cluster.id}`, err as Error);
        throw err;
      }
    };

    const act = async (cluster: IClusterInfo, action: ClusterAction): Promise<void> => {
      if (action === 'stop') {
        const orphan = cluster.orphaned ? ' Nothing owns it any more.' : ' Its ranks\' variables are lost.';
        const result = await showDialog({
          title: `Stop cluster ${cluster.id}?`,
          body: `Stops its ${cluster.n} ranks and the controller.${orphan}`,
          buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
        });
        if (!result.button.accept) {
          return;
        }
        await clusterAction(cluster.id, 'stop');
      } else if (action === 'interrupt') {
        await clusterAction(cluster.id, 'interrupt');
      } else if (action === 'where') {
        await showWhere(cluster);
      } else if (action === 'live') {
        await showLive(cluster);
      } else {
        try {
          await restartInKernel(app, cluster);
        } catch (err) {
          void showErrorMessage(`Restart ${cluster.id}`, err as Error);
          throw err;
        }
      }
    };

    const panel = new RingPanel(poller, act);
    panel.title.icon = ringIcon;
    app.shell.add(panel, 'left', { rank: 900 });

    if (statusBar) {
      const kernelId = () => tracker?.currentWidget?.sessionContext.session?.kernel?.id;
      const status = new RingStatus(poller, kernelId);
      statusBar.registerStatusItem('jupyter-ring:status', {
        item: status,
        align: 'left',
        rank: 4,
        isActive: () => true
      });
      tracker?.currentChanged.connect(() => status.update());
      tracker?.currentChanged.connect((_, nb) =>
        nb?.sessionContext.kernelChanged.connect(() => status.update())
      );
    }
    tracker?.widgetAdded.connect((_, nb) => watchRestarts(nb));
    // a cell that started or stopped a cluster: ask now, not at the next poll (the status bar
    // lagged the notebook by up to 3 s)
    NotebookActions.executed.connect((_, { cell }) => {
      if (changesClusters(cell.model.sharedModel.getSource())) {
        void poller.refresh();
      }
    });
    poller.start();
    void labShell;
  }
};

export default plugin;
