import { metaLabel, rankStateLabel, renderClusters } from '../src/render';
import { makeCluster } from './fixtures';

describe('a cluster whose ranks are replaced in place', () => {
  it('says the restarts used of --max-restarts in the card meta and marks the replaced rank', () => {
    const cluster = makeCluster({ restarts: { used: 1, max: 3 } });
    cluster.ranks[1].replaced = 1;
    const node = document.createElement('div');
    renderClusters(node, [cluster], { onAction: () => undefined });
    expect(node.querySelector('.jp-RingPanel-meta')!.textContent).toBe('2 ranks · restarts 1/3 · profile default');
    const rows = Array.from(node.querySelectorAll('tr.jp-RingPanel-rank')) as HTMLElement[];
    expect(rows.map(r => r.classList.contains('jp-mod-replaced'))).toEqual([false, true]);
    expect(rows[1].dataset.replaced).toBe('1');
    expect(rows[1].title).toContain('namespace started fresh');
    expect(rows.map(r => r.querySelectorAll('td')[1].textContent)).toEqual(['alive', 'alive · replaced 1×']);
  });

  it('shows nothing of restarts where ranks are not replaced (null) or none was (0)', () => {
    expect(metaLabel(makeCluster())).toBe('2 ranks · profile default');
    expect(metaLabel(makeCluster({ restarts: null }))).toBe('2 ranks · profile default');
    expect(metaLabel(makeCluster({ restarts: { used: 0, max: 3 } }))).toBe('2 ranks · restarts 0/3 · profile default');
    const rank = makeCluster().ranks[0];
    expect(rankStateLabel(rank)).toBe('alive');
    expect(rankStateLabel({ ...rank, replaced: 0 })).toBe('alive');
    expect(rankStateLabel({ ...rank, alive: false, replaced: 2 })).toBe('dead · replaced 2×');
  });
});
