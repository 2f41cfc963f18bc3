/** The left-sidebar Ring panel. */
import { Widget } from '@lumino/widgets';

import { IClusterInfo } from './model';
import { ClusterPoller } from './poller';
import { ClusterAction, renderClusters } from './render';

export class RingPanel extends Widget {
  constructor(
    private poller: ClusterPoller,
    private act: (cluster: IClusterInfo, action: ClusterAction) => Promise<void>
  ) {
    super();
    this.addClass('jp-RingPanel');
    this.id = 'jupyter-ring-panel';
    this.title.caption = 'Ring: jupyter_ring clusters';
    const title = document.createElement('h2');
    title.className = 'jp-RingPanel-title';
    title.textContent = 'Ring clusters';
    this.node.appendChild(title);
    this.list = document.createElement('div');
    this.list.className = 'jp-RingPanel-list';
    this.node.appendChild(this.list);
    this.unsubscribe = poller.subscribe(() => this.update());
  }

  dispose(): void {
    this.unsubscribe();
    super.dispose();
  }

  protected onUpdateRequest(): void {
    renderClusters(this.list, this.poller.clusters, {
      busy: this.busy,
      error: this.actionError ?? this.poller.error,
      onAction: (cluster, action) => void this.run(cluster, action)
    });
  }

  private async run(cluster: IClusterInfo, action: ClusterAction): Promise<void> {
    this.busy.add(cluster.id);
    this.actionError = null;
    this.update();
    try {
      await this.act(cluster, action);
    } catch (err) {
      this.actionError = `${action} ${cluster.id}: ${(err as Error).message}`;
    } finally {
      this.busy.delete(cluster.id);
      await this.poller.refresh();
    }
  }

  private list: HTMLElement;
  private busy = new Set<string>();
  private actionError: string | null = null;
  private unsubscribe: () => void;
}
