/** One poll of GET /jupyter-ring/clusters shared by the panel and the status bar. */
import { listClusters } from './api';
import { IClusterInfo } from './model';

export class ClusterPoller {
  constructor(private intervalMs = 2000) {}

  clusters: IClusterInfo[] = [];
  error: string | null = null;

  /** Call ``fn`` after every refresh; returns a function that removes it. */
  subscribe(fn: () => void): () => void {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  }

  start(): void {
    if (this.timer === null) {
      void this.refresh();
      this.timer = window.setInterval(() => void this.refresh(), this.intervalMs);
    }
  }

  stop(): void {
    if (this.timer !== null) {
      window.clearInterval(this.timer);
      this.timer = null;
    }
  }

  async refresh(): Promise<void> {
    if (this.inFlight) {
      return this.inFlight;
    }
    this.inFlight = (async () => {
      try {
        this.clusters = await listClusters();
        this.error = null;
      } catch (err) {
        this.error = `Could not list clusters: ${(err as Error).message}`;
      } finally {
        this.inFlight = null;
      }
      this.listeners.forEach(fn => fn());
    })();
    return this.inFlight;
  }

  private listeners = new Set<() => void>();
  private timer: number | null = null;
  private inFlight: Promise<void> | null = null;
}
