/**
 * DOM for the Ring panel: one card per cluster with its ranks and action buttons.
 * Plain DOM (no JupyterLab imports) so that it is unit-tested in jsdom.
 */
import {
  IClusterInfo,
  IRankInfo,
  IWhereReport,
  livenessLabel,
  ownerDetail,
  ownerLabel,
  ownerTitle,
  runningCellLabel,
  stateLabel
} from './model';

export type ClusterAction = 'interrupt' | 'restart' | 'stop' | 'where' | 'live';

export interface IRenderOptions {
  onAction: (cluster: IClusterInfo, action: ClusterAction) => void;
  /** Ids of clusters whose action is in flight: their buttons are disabled. */
  busy?: Set<string>;
  error?: string | null;
}

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

function button(
  cluster: IClusterInfo,
  action: ClusterAction,
  label: string,
  title: string,
  options: IRenderOptions,
  enabled: boolean
): HTMLButtonElement {
  const b = el('button', `jp-RingPanel-button jp-mod-${action}`, label);
  b.title = title;
  b.dataset.action = action;
  b.disabled = !enabled || (options.busy?.has(cluster.id) ?? false);
  b.addEventListener('click', () => options.onAction(cluster, action));
  return b;
}

/** One cluster: header (id, state, owner), buttons, and a table with a row per rank. */
export function renderCluster(cluster: IClusterInfo, options: IRenderOptions): HTMLElement {
  const card = el('div', 'jp-RingPanel-cluster');
  card.dataset.clusterId = cluster.id;
  card.dataset.state = cluster.state;
  if (cluster.orphaned) {
    card.classList.add('jp-mod-orphaned');
  }
  const header = el('div', 'jp-RingPanel-header');
  header.appendChild(el('span', 'jp-RingPanel-id', cluster.id));
  header.appendChild(el('span', `jp-RingPanel-state jp-mod-${cluster.state}`, stateLabel(cluster)));
  card.appendChild(header);
  card.appendChild(el('div', 'jp-RingPanel-meta', metaLabel(cluster)));
  // the notebook that owns the cluster first; the kernel id and pid after it, in grey
  const owner = el('div', 'jp-RingPanel-owner');
  owner.title = ownerTitle(cluster);
  owner.appendChild(el('span', 'jp-RingPanel-ownerName', ownerLabel(cluster)));
  const detail = ownerDetail(cluster);
  if (detail) {
    owner.appendChild(el('span', 'jp-RingPanel-ownerId', detail));
  }
  card.appendChild(owner);

  const live = cluster.state !== 'stopped';
  const actions = el('div', 'jp-RingPanel-actions');
  actions.appendChild(
    button(cluster, 'interrupt', 'Interrupt', 'Interrupt the running cell on all ranks (SIGINT)', options,
      live && !cluster.orphaned)
  );
  actions.appendChild(
    button(cluster, 'restart', 'Restart', cluster.owner.kernel_id
      ? 'Run %ring restart in the kernel that owns this cluster'
      : 'Only a cluster started by a kernel of this JupyterLab can be restarted', options,
      live && !cluster.orphaned && !!cluster.owner.kernel_id)
  );
  // reads the ranks from outside (a signal through the nannies): works while a cell is busy
  actions.appendChild(
    button(cluster, 'where', 'Where?', 'Show every rank\'s Python stack and the collective it is in',
      options, live)
  );
  actions.appendChild(
    button(cluster, 'stop', 'Stop', 'Stop every rank and the controller', options, live)
  );
  card.appendChild(actions);
  if (live && cluster.cell) {
    card.appendChild(renderRunningCell(cluster, options));
  }

  // What a user reads first comes first (rank, state, step): at the sidebar's default width the
  // last column was cut ("226/40"); what does not fit scrolls, nothing is cut off.
  const table = rankTable(cluster.ranks);
  if (cluster.ranks.length > COMPACT_FROM) {
    // 64 rows do not fit a sidebar: ranks alike (state, host) share a row, every rank in a
    // collapsed table below
    card.appendChild(groupTable(cluster.ranks));
    const all = el('details', 'jp-RingPanel-allRanks');
    all.appendChild(el('summary', '', `every rank (${cluster.ranks.length})`));
    const scroll = el('div', 'jp-RingPanel-ranksScroll');
    scroll.appendChild(table);
    all.appendChild(scroll);
    card.appendChild(all);
    return card;
  }
  const scroll = el('div', 'jp-RingPanel-ranksScroll');
  scroll.appendChild(table);
  card.appendChild(scroll);
  return card;
}

/** Above this many ranks a cluster's ranks are listed in groups (the full table collapsed). */
export const COMPACT_FROM = 16;

/** A row per rank: rank, state, step, host, pid, device. */
function rankTable(ranks: IRankInfo[]): HTMLTableElement {
  const table = el('table', 'jp-RingPanel-ranks');
  const head = el('tr', '');
  for (const name of ['rank', 'state', 'step', 'host', 'pid', 'device']) {
    head.appendChild(el('th', '', name));
  }
  table.appendChild(head);
  for (const rank of ranks) {
    const row = el('tr', `jp-RingPanel-rank jp-mod-${livenessLabel(rank)}`);
    row.dataset.rank = String(rank.rank);
    markReplaced(row, rank);
    const cells = [
      String(rank.rank),
      rankStateLabel(rank),
      stepLabel(rank),
      rank.host ?? '?',
      rank.pid === null ? '?' : String(rank.pid),
      rank.device ?? '?'
    ];
    for (const text of cells) {
      row.appendChild(el('td', '', text));
    }
    table.appendChild(row);
  }
  return table;
}

/** Ranks that share a state and a host, with the span of their steps. */
export interface IRankGroup {
  ranks: number[];
  state: string;
  host: string;
  steps: string;
}

/**
 * The ranks in groups of one state and host, the groups that are not alive first (what needs
 * the user), then by their first rank; ``steps`` is the group's lowest and highest step.
 */
export function rankGroups(ranks: IRankInfo[]): IRankGroup[] {
  const groups = new Map<string, { ranks: number[]; state: string; host: string; steps: number[] }>();
  for (const rank of ranks) {
    const state = livenessLabel(rank);
    const host = rank.host ?? '?';
    const key = `${state}\u0000${host}`;
    let group = groups.get(key);
    if (!group) {
      group = { ranks: [], state, host, steps: [] };
      groups.set(key, group);
    }
    group.ranks.push(rank.rank);
    if (rank.step !== null && rank.step !== undefined) {
      group.steps.push(rank.step);
    }
  }
  const out = Array.from(groups.values()).map(g => {
    const low = Math.min(...g.steps);
    const high = Math.max(...g.steps);
    const steps = !g.steps.length ? '–' : low === high ? String(low) : `${low}–${high}`;
    return { ranks: g.ranks.sort((a, b) => a - b), state: g.state, host: g.host, steps };
  });
  return out.sort((a, b) => Number(a.state === 'alive') - Number(b.state === 'alive') || a.ranks[0] - b.ranks[0]);
}

/** ``[0, 1, 2, 5]`` -> ``0-2, 5``. */
export function rankRanges(ranks: number[]): string {
  const parts: string[] = [];
  let i = 0;
  while (i < ranks.length) {
    let j = i;
    while (j + 1 < ranks.length && ranks[j + 1] === ranks[j] + 1) {
      j++;
    }
    parts.push(i === j ? String(ranks[i]) : `${ranks[i]}-${ranks[j]}`);
    i = j + 1;
  }
  return parts.join(', ');
}

/** A row per group of ranks (``rankGroups``): ranks, how many, state, steps, host. */
function groupTable(ranks: IRankInfo[]): HTMLTableElement {
  const table = el('table', 'jp-RingPanel-groups');
  const head = el('tr', '');
  for (const name of ['ranks', 'n', 'state', 'step', 'host']) {
    head.appendChild(el('th', '', name));
  }
  table.appendChild(head);
  for (const group of rankGroups(ranks)) {
    const row = el('tr', `jp-RingPanel-group jp-mod-${group.state}`);
    for (const text of [rankRanges(group.ranks), String(group.ranks.length), group.state, group.steps, group.host]) {
      row.appendChild(el('td', '', text));
    }
    table.appendChild(row);
  }
  return table;
}

/**
 * The cell the owner kernel runs, with "Show live view": a notebook closed and reopened while
 * the cell runs shows its saved output, and this brings the live one back (./livecell).
 */
function renderRunningCell(cluster: IClusterInfo, options: IRenderOptions): HTMLElement {
  const line = el('div', 'jp-RingPanel-cell');
  line.appendChild(el('span', 'jp-RingPanel-cellLabel', runningCellLabel(cluster.cell!)));
  line.appendChild(
    button(cluster, 'live', 'Show live view',
      'Show this cell\'s live dashboard and rank output in its notebook (after the notebook was closed and reopened)',
      options, !!cluster.owner.kernel_id)
  );
  return line;
}

/** Replace ``node``'s content with every cluster (or a hint when there is none). */
export function renderClusters(
  node: HTMLElement,
  clusters: IClusterInfo[],
  options: IRenderOptions
): void {
  node.textContent = '';
  if (options.error) {
    node.appendChild(el('div', 'jp-RingPanel-error', options.error));
  }
  if (!clusters.length) {
    node.appendChild(
      el('div', 'jp-RingPanel-empty', 'No jupyter_ring clusters. In a notebook: %load_ext jupyter_ring, then %ring start -n 2')
    );
    return;
  }
  for (const cluster of clusters) {
    node.appendChild(renderCluster(cluster, options));
  }
}

/**
 * The body of the Where? dialog: a line per rank saying what it is doing (the waiting and
 * unreadable ones stand out), then the report %ring where prints, monospace.
 */
export function renderWhereReport(report: IWhereReport, at: Date = new Date()): HTMLElement {
  const body = el('div', 'jp-RingPanel-where');
  body.dataset.clusterId = report.id;
  body.appendChild(
    el('div', 'jp-RingPanel-whereMeta',
      `${report.ranks.length} rank(s) at ${at.toLocaleTimeString()}, innermost frame first`)
  );
  const summary = el('ul', 'jp-RingPanel-whereRanks');
  for (const line of whereLines(report.ranks)) {
    const many = line.ranks.length > 1;
    const item = el('li', `jp-mod-${line.state}`,
      `${many ? 'ranks' : 'rank'} ${rankRanges(line.ranks)}: ${line.doing}`);
    item.dataset[many ? 'ranks' : 'rank'] = rankRanges(line.ranks);
    summary.appendChild(item);
  }
  body.appendChild(summary);
  body.appendChild(el('pre', 'jp-RingPanel-whereText', report.text));
  return body;
}

/** One line of the Where? dialog: the ranks it stands for, their state class and what they do. */
export interface IWhereLine {
  ranks: number[];
  state: string;
  doing: string;
}

/**
 * The Where? dialog's lines: a line per rank up to ``COMPACT_FROM`` ranks; beyond, ranks whose
 * line reads alike but for its seconds share one (64 ranks waiting in one allreduce: one line,
 * worded as its first rank's), in the order of their first rank.
 */
export function whereLines(ranks: IWhereReport['ranks']): IWhereLine[] {
  const lines = ranks.map(rank => ({
    ranks: [rank.rank],
    state: rank.problem ? 'unread' : rank.state,
    doing: rank.problem ? 'stack not read' : rank.doing || rank.state
  }));
  if (lines.length <= COMPACT_FROM) {
    return lines;
  }
  const groups = new Map<string, IWhereLine>();
  for (const line of [...lines].sort((a, b) => a.ranks[0] - b.ranks[0])) {
    const key = `${line.state}|${line.doing.replace(/\d+(\.\d+)? s\b/g, 's')}`;
    const group = groups.get(key);
    if (group) {
      group.ranks.push(line.ranks[0]);
    } else {
      groups.set(key, { ...line, ranks: [...line.ranks] });
    }
  }
  return Array.from(groups.values());  // in the order of their first rank, each's ranks sorted
}

/** The card's meta line: "2 ranks · restarts 1/3 · profile default" (restarts where ranks are
 * replaced in place). */
export function metaLabel(cluster: IClusterInfo): string {
  const restarts = cluster.restarts ? ` · restarts ${cluster.restarts.used}/${cluster.restarts.max}` : '';
  return `${cluster.n} ranks${restarts} · profile ${cluster.profile}`;
}

/** A replaced rank's row: marked (class jp-mod-replaced), its state cell says so, the tooltip why. */
function markReplaced(row: HTMLElement, rank: IRankInfo): void {
  const times = rank.replaced ?? 0;
  if (times <= 0) {
    return;
  }
  row.classList.add('jp-mod-replaced');
  row.dataset.replaced = String(times);
  row.title = `Rank ${rank.rank} was replaced in place ${times}× (a new engine): its namespace ` +
    'started fresh; %ring sync NAME copies variables to it';
}

/** "alive · replaced 1×" for a replaced rank's state cell, else the liveness alone. */
export function rankStateLabel(rank: IRankInfo): string {
  const times = rank.replaced ?? 0;
  return times > 0 ? `${livenessLabel(rank)} · replaced ${times}×` : livenessLabel(rank);
}

/** "120/500", "120" or "–" (no report yet). */
export function stepLabel(rank: IRankInfo): string {
  if (rank.step === null || rank.step === undefined) {
    return '–';
  }
  return rank.total ? `${rank.step}/${rank.total}` : String(rank.step);
}
