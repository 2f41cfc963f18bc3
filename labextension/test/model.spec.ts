import {
  aliveRanks,
  changesClusters,
  clusterForKernel,
  livenessLabel,
  ownerDetail,
  ownerLabel,
  ownerTitle,
  stateLabel,
  statusText
} from '../src/model';
import { makeCluster } from './fixtures';

describe('clusterForKernel', () => {
  it('finds the cluster started by the kernel', () => {
    const mine = makeCluster();
    const other = makeCluster({ id: '1795400640-aaaa', owner: { ...mine.owner, kernel_id: 'k-2' } });
    expect(clusterForKernel([other, mine], 'k-1')).toBe(mine);
    expect(clusterForKernel([other, mine], 'k-3')).toBeUndefined();
    expect(clusterForKernel([other, mine], null)).toBeUndefined();
  });

  it('prefers the newest live cluster and ignores stopped ones', () => {
    const old = makeCluster({ id: '1000-aaaa' });
    const newer = makeCluster({ id: '2000-bbbb' });
    const stopped = makeCluster({ id: '3000-cccc', state: 'stopped' });
    expect(clusterForKernel([old, stopped, newer], 'k-1')).toBe(newer);
  });
});

describe('statusText', () => {
  it('shows state and rank count', () => {
    expect(statusText(makeCluster())).toBe('Ring: running · 2 ranks');
    expect(statusText(makeCluster({ n: 1 }))).toBe('Ring: running · 1 rank');
    expect(statusText(undefined)).toBe('Ring: no cluster');
  });

  it('counts live ranks of a degraded cluster', () => {
    const c = makeCluster({ state: 'degraded' });
    c.ranks[1].alive = false;
    expect(aliveRanks(c)).toBe(1);
    expect(statusText(c)).toBe('Ring: degraded · 1/2 ranks');
  });
});

describe('labels', () => {
  it('marks orphans and owners that are gone', () => {
    const c = makeCluster({ orphaned: true, owner: { pid: 4242, alive: false, kernel_id: null, name: null } });
    expect(stateLabel(c)).toBe('orphaned (running)');
    expect(ownerLabel(c)).toBe('owner pid 4242 is gone');
    expect(ownerLabel(makeCluster())).toBe('kernel k-1 (pid 4242)');
  });

  it('names the owner by its notebook, the kernel id second', () => {
    const owner = {
      pid: 5215,
      alive: true,
      kernel_id: '620986e1-5d2c-4b8f-9d7e-0123456789ab',
      name: 'python',
      session: { path: 'course/week 1/03-pytorch.ipynb', name: '03-pytorch.ipynb', type: 'notebook' }
    };
    const c = makeCluster({ owner });
    expect(ownerLabel(c)).toBe('03-pytorch.ipynb');
    expect(ownerDetail(c)).toBe('kernel 620986e1 · pid 5215');
    expect(ownerTitle(c)).toBe(
      'notebook: course/week 1/03-pytorch.ipynb\nkernel 620986e1-5d2c-4b8f-9d7e-0123456789ab\npid 5215'
    );
    // a console's session is named by its name; no session: the kernel, as before
    const consoleOwner = { ...owner, session: { path: 'console-1-abc', name: 'Console 1', type: 'console' } };
    expect(ownerLabel(makeCluster({ owner: consoleOwner }))).toBe('Console 1');
    const bare = makeCluster({ owner: { ...owner, session: null } });
    expect(ownerLabel(bare)).toBe('kernel 620986e1 (pid 5215)');
    expect(ownerDetail(bare)).toBe('');
    // an owner that is gone is not named by a session it no longer has
    const gone = makeCluster({ owner: { ...owner, alive: false } });
    expect(ownerLabel(gone)).toBe('owner pid 5215 is gone');
    expect(ownerDetail(gone)).toBe('');
  });

  it('says unknown for ranks on other hosts', () => {
    const rank = { rank: 0, host: 'node2', pid: 1, device: null, alive: null, step: null };
    expect(livenessLabel(rank)).toBe('unknown');
    expect(livenessLabel({ ...rank, alive: false })).toBe('dead');
  });
});

describe('changesClusters', () => {
  it('is true for the cells that start, stop or restart a cluster, and for no other', () => {
    expect(changesClusters('%ring start -n 2')).toBe(true);
    expect(changesClusters('%load_ext jupyter_ring\n%ring start')).toBe(true);
    expect(changesClusters('  %ring stop')).toBe(true);
    expect(changesClusters('%ring restart')).toBe(true);
    expect(changesClusters('%ring status')).toBe(false);
    expect(changesClusters('%%distributed\nx = 1')).toBe(false);
    expect(changesClusters('print("%ring starts")')).toBe(false);
  });
});
