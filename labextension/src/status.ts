/** Status-bar item: state and rank count of the current notebook kernel's cluster. */
import { Widget } from '@lumino/widgets';

import { clusterForKernel, statusText } from './model';
import { ClusterPoller } from './poller';

export class RingStatus extends Widget {
  constructor(
    private poller: ClusterPoller,
    private kernelId: () => string | null | undefined
  ) {
    super();
    this.addClass('jp-RingStatus');
    this.node.title = 'jupyter_ring cluster of this notebook (Ring panel on the left)';
    this.unsubscribe = poller.subscribe(() => this.update());
    this.update();
  }

  dispose(): void {
    this.unsubscribe();
    super.dispose();
  }

  protected onUpdateRequest(): void {
    const cluster = clusterForKernel(this.poller.clusters, this.kernelId());
    this.node.textContent = statusText(cluster);
    this.node.dataset.state = cluster ? cluster.state : 'none';
  }

  private unsubscribe: () => void;
}
