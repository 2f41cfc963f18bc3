import { COMPACT_FROM, rankGroups, rankRanges, renderClusters, renderWhereReport, whereLines } from '../src/render';
import { makeCluster } from './fixtures';

function buttons(node: HTMLElement): Record<string, HTMLButtonElement> {
  const found: Record<string, HTMLButtonElement> = {};
  node.querySelectorAll('button').forEach(b => (found[b.dataset.action!] = b as HTMLButtonElement));
  return found;
}

describe('renderClusters', () => {
  it('lists each rank with liveness and step first, then host, pid and device', () => {
    const node = document.createElement('div');
    renderClusters(node, [makeCluster()], { onAction: () => undefined });
    const rows = node.querySelectorAll('tr.jp-RingPanel-rank');
    expect(rows).toHaveLength(2);
    const cells = Array.from(rows[1].querySelectorAll('td')).map(td => td.textContent);
    expect(cells).toEqual(['1', 'alive', '–', 'vm', '201', 'cpu']);
    expect(node.querySelector('.jp-RingPanel-ranksScroll > table.jp-RingPanel-ranks')).not.toBeNull();
    expect(node.querySelector('.jp-RingPanel-state')!.textContent).toBe('running');
  });

  it('shows a rank\'s step, with its total when known', () => {
    const node = document.createElement('div');
    const cluster = makeCluster();
    cluster.ranks[0].step = 120;
    cluster.ranks[0].total = 500;
    cluster.ranks[1].step = 7;
    renderClusters(node, [cluster], { onAction: () => undefined });
    const steps = Array.from(node.querySelectorAll('tr.jp-RingPanel-rank')).map(
      row => row.querySelectorAll('td')[2].textContent
    );
    expect(steps).toEqual(['120/500', '7']);
  });

  it('shows the owner notebook first and its kernel id in a second, secondary span', () => {
    const node = document.createElement('div');
    const cluster = makeCluster({
      owner: {
        pid: 5215,
        alive: true,
        kernel_id: '620986e1-5d2c-4b8f-9d7e-0123456789ab',
        name: 'python',
        session: { path: 'work/ring.ipynb', name: 'ring.ipynb', type: 'notebook' }
      }
    });
    renderClusters(node, [cluster], { onAction: () => undefined });
    const owner = node.querySelector('.jp-RingPanel-owner') as HTMLElement;
    const spans = Array.from(owner.children).map(child => [child.className, child.textContent]);
    expect(spans).toEqual([
      ['jp-RingPanel-ownerName', 'ring.ipynb'],
      ['jp-RingPanel-ownerId', 'kernel 620986e1 · pid 5215']
    ]);
    expect(owner.title).toContain('notebook: work/ring.ipynb');
    expect(node.querySelector('.jp-RingPanel-meta')!.textContent).toBe('2 ranks · profile default');
  });

  it('calls onAction with the cluster and the action', () => {
    const node = document.createElement('div');
    const calls: string[] = [];
    const cluster = makeCluster();
    renderClusters(node, [cluster], { onAction: (c, a) => calls.push(`${c.id}:${a}`) });
    const b = buttons(node);
    b.interrupt.click();
    b.stop.click();
    b.restart.click();
    expect(calls).toEqual([`${cluster.id}:interrupt`, `${cluster.id}:stop`, `${cluster.id}:restart`]);
  });

  it('offers only stop for an orphan, and disables buttons while busy', () => {
    const node = document.createElement('div');
    const orphan = makeCluster({ orphaned: true, owner: { pid: 9, alive: false, kernel_id: null, name: null } });
    renderClusters(node, [orphan], { onAction: () => undefined });
    let b = buttons(node);
    expect(node.querySelector('.jp-RingPanel-cluster')!.classList.contains('jp-mod-orphaned')).toBe(true);
    expect(node.textContent).toContain('orphaned (running)');
    expect([b.interrupt.disabled, b.restart.disabled, b.stop.disabled]).toEqual([true, true, false]);
    renderClusters(node, [orphan], { onAction: () => undefined, busy: new Set([orphan.id]) });
    b = buttons(node);
    expect(b.stop.disabled).toBe(true);
  });

  it('shows a hint when there is no cluster, and errors', () => {
    const node = document.createElement('div');
    renderClusters(node, [], { onAction: () => undefined, error: 'Could not list clusters: 500' });
    expect(node.querySelector('.jp-RingPanel-empty')!.textContent).toContain('%ring start');
    expect(node.querySelector('.jp-RingPanel-error')!.textContent).toContain('500');
  });
});

describe('renderWhereReport', () => {
  // 64 ranks: 62 wait in one allreduce (each for its own seconds), rank 5 runs its own code,
  // rank 40's stack was not read
  function sixtyFour() {
    return Array.from({ length: 64 }, (_, rank) => {
      const base = { rank, host: 'vm', pid: 1000 + rank, waiting_for: [5], threads: [], problem: '' };
      if (rank === 5) {
        return { ...base, state: 'running', waiting_for: [], doing: 'running (not in a collective)' };
      }
      if (rank === 40) {
        return { ...base, state: 'unknown', waiting_for: [], doing: '', problem: 'no stack dump within 3 s' };
      }
      const s = (3 + rank / 100).toFixed(2);
      return { ...base, state: 'waiting', doing: `inside allreduce 'g' for ${s} s, waiting for rank(s) 5 for ${s} s` };
    });
  }

  it('gives 64 ranks a line per thing they do, their ranks as ranges, in rank order', () => {
    const ranks = sixtyFour();
    expect(whereLines(ranks).map(l => [rankRanges(l.ranks), l.state])).toEqual([
      ['0-4, 6-39, 41-63', 'waiting'], ['5', 'running'], ['40', 'unread']
    ]);
    const body = renderWhereReport({ id: 'c-64', text: '(report)', ranks: [...ranks].reverse() });
    const items = Array.from(body.querySelectorAll('li')).map(li => li.textContent);
    expect(items).toEqual([
      "ranks 0-4, 6-39, 41-63: inside allreduce 'g' for 3.00 s, waiting for rank(s) 5 for 3.00 s",
      'rank 5: running (not in a collective)',
      'rank 40: stack not read'
    ]);
    expect(body.querySelector('li[data-ranks="0-4, 6-39, 41-63"]')).not.toBeNull();
    expect(body.querySelector('li[data-rank="5"]')).not.toBeNull();
    expect(body.querySelector('.jp-RingPanel-whereMeta')!.textContent).toContain('64 rank(s) at');
  });

  it(`keeps a line per rank up to ${COMPACT_FROM} ranks`, () => {
    const ranks = sixtyFour().slice(0, COMPACT_FROM);
    expect(whereLines(ranks).map(l => l.ranks)).toEqual(ranks.map(r => [r.rank]));
  });

  it('offers Where? on a live cluster, also an orphan, and calls onAction with it', () => {
    const node = document.createElement('div');
    const calls: string[] = [];
    const cluster = makeCluster();
    renderClusters(node, [cluster], { onAction: (c, a) => calls.push(`${c.id}:${a}`) });
    const b = buttons(node);
    expect(b.where.textContent).toBe('Where?');
    b.where.click();
    expect(calls).toEqual([`${cluster.id}:where`]);
    const orphan = makeCluster({ orphaned: true, owner: { pid: 9, alive: false, kernel_id: null, name: null } });
    renderClusters(node, [orphan], { onAction: () => undefined });
    expect(buttons(node).where.disabled).toBe(false);
    renderClusters(node, [makeCluster({ state: 'stopped' })], { onAction: () => undefined });
    expect(buttons(node).where.disabled).toBe(true);
  });

  it('shows a line per rank (what it does, or that its stack was not read) and the text, monospace', () => {
    const text =
      "rank 0 @ vm (pid 200): inside allreduce 'grads' for 3.1 s, waiting for rank(s) 1 for 3.0 s\n" +
      '  main thread, innermost frame first:\n' +
      '    File "/tmp/ipykernel_200/1.py", line 4, in <module>\n' +
      "rank 1 @ vm (pid 201): running (not in a collective)\n" +
      '    File "/tmp/ipykernel_201/1.py", line 2, in stuck_here';
    const body = renderWhereReport({
      id: 'c-1',
      text,
      ranks: [
        { rank: 0, host: 'vm', pid: 200, state: 'waiting', waiting_for: [1], problem: '', threads: [],
          doing: "inside allreduce 'grads' for 3.1 s, waiting for rank(s) 1 for 3.0 s" },
        { rank: 1, host: 'vm', pid: 201, state: 'running', waiting_for: [], threads: [],
          doing: 'running (not in a collective)', problem: '' },
        { rank: 2, host: 'other', pid: 7, state: 'unknown', waiting_for: [], threads: [], doing: '',
          problem: 'no stack file here' }
      ]
    });
    const items = Array.from(body.querySelectorAll('li')).map(li => [li.className, li.textContent]);
    expect(items).toEqual([
      ['jp-mod-waiting', "rank 0: inside allreduce 'grads' for 3.1 s, waiting for rank(s) 1 for 3.0 s"],
      ['jp-mod-running', 'rank 1: running (not in a collective)'],
      ['jp-mod-unread', 'rank 2: stack not read']
    ]);
    const pre = body.querySelector('pre.jp-RingPanel-whereText')!;
    expect(pre.textContent).toBe(text);
    expect(body.querySelector('.jp-RingPanel-whereMeta')!.textContent).toContain('3 rank(s) at');
  });
});

describe('a large cluster', () => {
  function large(): ReturnType<typeof makeCluster> {
    const ranks = Array.from({ length: 64 }, (_, rank) => ({
      rank,
      host: rank < 32 ? 'node-a' : 'node-b',
      pid: 1000 + rank,
      device: 'cpu',
      alive: rank !== 17,
      step: rank === 40 ? 90 : 100 + (rank % 3)
    }));
    return makeCluster({ n: 64, ranks });
  }

  it('writes rank lists as ranges', () => {
    expect(rankRanges([0, 1, 2, 5, 7, 8])).toBe('0-2, 5, 7-8');
    expect(rankRanges([3])).toBe('3');
  });

  it('groups ranks alike (state, host) into a row each, the ranks that are not alive first', () => {
    const groups = rankGroups(large().ranks);
    expect(groups).toEqual([
      { ranks: [17], state: 'dead', host: 'node-a', steps: '102' },
      { ranks: [...Array.from({ length: 17 }, (_, r) => r), ...Array.from({ length: 14 }, (_, r) => r + 18)],
        state: 'alive', host: 'node-a', steps: '100–102' },
      { ranks: Array.from({ length: 32 }, (_, r) => r + 32), state: 'alive', host: 'node-b', steps: '90–102' }
    ]);
  });

  it('lists 64 ranks in three rows, with every rank in a collapsed table', () => {
    const node = document.createElement('div');
    renderClusters(node, [large()], { onAction: () => undefined });
    const rows = Array.from(node.querySelectorAll('tr.jp-RingPanel-group')).map(row =>
      Array.from(row.querySelectorAll('td')).map(td => td.textContent)
    );
    expect(rows).toEqual([
      ['17', '1', 'dead', '102', 'node-a'],
      ['0-16, 18-31', '31', 'alive', '100–102', 'node-a'],
      ['32-63', '32', 'alive', '90–102', 'node-b']
    ]);
    const details = node.querySelector('details.jp-RingPanel-allRanks') as HTMLDetailsElement;
    expect(details.open).toBe(false);
    expect(details.querySelectorAll('tr.jp-RingPanel-rank')).toHaveLength(64);
  });

  it(`keeps a row per rank up to ${COMPACT_FROM} ranks`, () => {
    const node = document.createElement('div');
    const cluster = large();
    cluster.ranks = cluster.ranks.slice(0, COMPACT_FROM);
    renderClusters(node, [cluster], { onAction: () => undefined });
    expect(node.querySelector('tr.jp-RingPanel-group')).toBeNull();
    expect(node.querySelectorAll('tr.jp-RingPanel-rank')).toHaveLength(COMPACT_FROM);
  });
});
