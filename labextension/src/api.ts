/** Calls to the server routes of jupyter_ring.server (authenticated by JupyterLab's settings). */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IClusterInfo, IWhereReport } from './model';

async function request<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'jupyter-ring', path);
  const response = await ServerConnection.makeRequest(url, init, settings);
  const text = await response.text();
  let data: any = text;
  try {
    data = text ? JSON.parse(text) : {};
  } catch {
    // tornado's HTML error page: keep the text for the message
  }
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response, data?.message || String(data));
  }
  return data as T;
}

/** Every cluster in the IPython profiles. */
export async function listClusters(): Promise<IClusterInfo[]> {
  const data = await request<{ clusters: IClusterInfo[] }>('clusters');
  return data.clusters;
}

/** POST an action (interrupt | stop | attach: the running cell's live view) for one cluster. */
export async function clusterAction(id: string, action: 'interrupt' | 'stop' | 'attach'): Promise<unknown> {
  return request(`clusters/${encodeURIComponent(id)}/${action}`, { method: 'POST' });
}

/** Every rank's stack and collective (POST .../where): works while the owner kernel is busy. */
export async function whereCluster(id: string): Promise<IWhereReport> {
  return request<IWhereReport>(`clusters/${encodeURIComponent(id)}/where`, { method: 'POST' });
}
