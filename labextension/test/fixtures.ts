import { IClusterInfo } from '../src/model';

/** A running 2-rank cluster owned by kernel k-1, as the server reports it. */
export function makeCluster(overrides: Partial<IClusterInfo> = {}): IClusterInfo {
  return {
    id: '1795400639-v1wr',
    profile: 'default',
    profile_dir: '/home/u/.ipython/profile_default',
    cluster_file: '/home/u/.ipython/profile_default/security/cluster-1795400639-v1wr.json',
    state: 'running',
    orphaned: false,
    n: 2,
    owner: { pid: 4242, alive: true, kernel_id: 'k-1', name: 'python' },
    controller: { pid: 100, alive: true },
    engine_sets: [{ id: '1795400639', n: 2, pid: 101, alive: true }],
    ranks: [0, 1].map(rank => ({
      rank,
      host: 'vm',
      pid: 200 + rank,
      device: 'cpu',
      alive: true,
      step: null
    })),
    metrics: null,
    ...overrides
  };
}
