/**
 * What the server reports about a cluster (GET /jupyter-ring/clusters), and pure helpers the
 * panel and the status bar share. Nothing here touches JupyterLab, so it is unit-tested alone.
 */

export interface IRankInfo {
  rank: number;
  host: string | null;
  pid: number | null;
  device: string | null;
  /** true/false from the process table; null when the rank runs on another host. */
  alive: boolean | null;
  /** The rank's last ring.progress() step as the owner kernel's dashboard saw it; null: none yet. */
  step: number | null;
  /** That progress's total, when the rank gave one. */
  total?: number | null;
  /** How many times the rank was replaced in place (a new engine, a fresh namespace); 0: never. */
  replaced?: number;
}

/** A Jupyter session of the owner kernel (from the server's session manager). */
export interface ISessionInfo {
  /** The notebook's path relative to the server's root (a console's or file's for other types). */
  path: string | null;
  name: string | null;
  type: string | null;
}

export interface IOwnerInfo {
  pid: number | null;
  alive: boolean;
  /** The Jupyter kernel that started the cluster, when it is one of this server's kernels. */
  kernel_id: string | null;
  name: string | null;
  /** That kernel's session (its notebook); null when the kernel has none (or is not ours). */
  session?: ISessionInfo | null;
}

export type ClusterState = 'running' | 'starting' | 'degraded' | 'stopped';

export interface IClusterInfo {
  id: string;
  profile: string;
  profile_dir: string;
  cluster_file: string;
  state: ClusterState;
  orphaned: boolean;
  n: number;
  owner: IOwnerInfo;
  controller: { pid: number | null; alive: boolean };
  engine_sets: { id: string; n: number; pid: number | null; alive: boolean }[];
  ranks: IRankInfo[];
  /** The ``%%distributed`` cell the owner kernel runs now (jupyter_ring._live); null between cells. */
  cell?: IRunningCell | null;
  /** Dead ranks replaced in place so far of --max-restarts; null: the cluster does not replace them. */
  restarts?: { used: number; max: number } | null;
  /** Reserved for the metrics issue (per-cluster summary); null until then. */
  metrics: unknown | null;
}

/** A running cell, as the server reads it from the cluster's files. */
export interface IRunningCell {
  /** The notebook's id of the cell (JupyterLab sends it with the execute request). */
  cell_id: string | null;
  /** The execute request's id: the parent of every output the cell makes. */
  msg_id: string | null;
  execution_count: number | null;
  /** When it started (seconds since the epoch). */
  started: number;
  kernel_pid: number;
}

/** "cell [12] running for 3 min 5 s": the panel's line for a running cell. */
export function runningCellLabel(cell: IRunningCell, now: number = Date.now() / 1000): string {
  const count = cell.execution_count === null ? '' : ` [${cell.execution_count}]`;
  const seconds = Math.max(0, Math.round(now - cell.started));
  const minutes = Math.floor(seconds / 60);
  const took = minutes ? `${minutes} min ${seconds % 60} s` : `${seconds} s`;
  return `cell${count} running for ${took}`;
}

/** One rank's answer in POST /jupyter-ring/clusters/<id>/where (jupyter_ring.cluster._where). */
export interface IWhereRank {
  rank: number;
  host: string | null;
  pid: number | null;
  /** running | collective | waiting | unknown (no record of the rank's collective). */
  state: string;
  /** "inside allreduce 'grads' for 12.4 s, waiting for rank(s) 1 for 12.4 s"; '' when unknown. */
  doing: string;
  waiting_for: number[];
  /** Why the rank's stack could not be read (no dump in time, no file on this host); '' if read. */
  problem: string;
  threads: {
    thread: string;
    main: boolean;
    hidden: number;
    hidden_inside: number;
    frames: { file: string; line: number; function: string; source: string }[];
  }[];
}

/** The where route's answer: every rank's record, and ``text``, the report %ring where prints. */
export interface IWhereReport {
  id: string;
  ranks: IWhereRank[];
  text: string;
}

/** The cluster started by kernel ``kernelId`` (the newest if there are several). */
export function clusterForKernel(
  clusters: IClusterInfo[],
  kernelId: string | null | undefined
): IClusterInfo | undefined {
  if (!kernelId) {
    return undefined;
  }
  return clusters
    .filter(c => c.owner.kernel_id === kernelId && c.state !== 'stopped')
    .sort((a, b) => (a.id < b.id ? 1 : a.id > b.id ? -1 : 0))[0];
}

/** Number of ranks whose process is known to be alive. */
export function aliveRanks(cluster: IClusterInfo): number {
  return cluster.ranks.filter(r => r.alive !== false).length;
}

/** The status bar's text for the current notebook's cluster. */
export function statusText(cluster: IClusterInfo | undefined): string {
  if (!cluster) {
    return 'Ring: no cluster';
  }
  const plural = cluster.n === 1 ? 'rank' : 'ranks';
  if (cluster.state === 'degraded') {
    return `Ring: degraded · ${aliveRanks(cluster)}/${cluster.n} ${plural}`;
  }
  return `Ring: ${cluster.state} · ${cluster.n} ${plural}`;
}

/** A short label for a cluster's state, with the orphan flag first when it applies. */
export function stateLabel(cluster: IClusterInfo): string {
  return cluster.orphaned ? `orphaned (${cluster.state})` : cluster.state;
}

/** A rank's liveness as a word. */
export function livenessLabel(rank: IRankInfo): string {
  if (rank.alive === null) {
    return 'unknown';
  }
  return rank.alive ? 'alive' : 'dead';
}

/** Who started the cluster, in words: its notebook when known, else the kernel or process. */
export function ownerLabel(cluster: IClusterInfo): string {
  const o = cluster.owner;
  if (!o.alive) {
    return o.pid ? `owner pid ${o.pid} is gone` : 'owner is gone';
  }
  const session = o.kernel_id ? o.session : null;
  if (session && (session.path || session.name)) {
    const path = session.path || session.name || '';
    return session.type === 'notebook' || path.endsWith('.ipynb') ? basename(path) : session.name || path;
  }
  if (o.kernel_id) {
    return `kernel ${shortId(o.kernel_id)} (pid ${o.pid})`;
  }
  return `${o.name || 'process'} pid ${o.pid}`;
}

/** The ids behind the owner's name, shown second: "kernel 620986e1 · pid 5215" ('' if none). */
export function ownerDetail(cluster: IClusterInfo): string {
  const o = cluster.owner;
  if (!o.alive || !o.kernel_id || !(o.session && (o.session.path || o.session.name))) {
    return '';
  }
  return `kernel ${shortId(o.kernel_id)} · pid ${o.pid}`;
}

/** The owner's tooltip: the notebook's full path and the whole kernel id. */
export function ownerTitle(cluster: IClusterInfo): string {
  const o = cluster.owner;
  const lines = [];
  if (o.kernel_id && o.session?.path) {
    lines.push(`${o.session.type || 'session'}: ${o.session.path}`);
  }
  if (o.kernel_id) {
    lines.push(`kernel ${o.kernel_id}`);
  }
  if (o.pid) {
    lines.push(`pid ${o.pid}${o.alive ? '' : ' (gone)'}`);
  }
  return lines.join('\n');
}

function shortId(id: string): string {
  return id.slice(0, 8);
}

function basename(path: string): string {
  return path.split('/').pop() || path;
}

/**
 * Whether a cell that just ran can have changed a cluster (``%ring start``, ``stop``,
 * ``restart``, ``scale``...): then the panel and the status bar ask at once instead of at the
 * next poll, so they do not lag the notebook by up to a poll's interval.
 */
export function changesClusters(source: string): boolean {
  return /^\s*%ring\s+(start|stop|restart)\b/m.test(source);
}
