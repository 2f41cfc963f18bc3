/**
 * "Show live view": a notebook closed and reopened while its ``%%distributed`` cell runs shows
 * the notebook as last saved, and nothing the kernel sends for that cell reaches it (JupyterLab
 * files a kernel's messages under the request that caused them, and this page never made the
 * request). The Ring panel knows the running cell (the server reads it from the cluster's files:
 * ``jupyter_ring._live``); this asks the kernel, through the server, to show the cell's live
 * dashboard and rank tabs again (its cell loop serves the request while the kernel is busy),
 * and puts every output of the running request into the cell from then on, in place of its old
 * output, updated as the kernel updates it. When the cell ends they are its final static views.
 */
import type { Cell, CodeCell } from '@jupyterlab/cells';
import type * as nbformat from '@jupyterlab/nbformat';
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import type { Kernel, KernelMessage } from '@jupyterlab/services';

import { clusterAction } from './api';
import { IClusterInfo, IRunningCell } from './model';

/** Opens a notebook by path (the document manager's open command). */
export type OpenNotebook = (path: string) => Promise<NotebookPanel | undefined>;

/** The outputs of one running request, as they reach a cell of this page. */
export class LiveOutputs {
  constructor(
    private outputs: {
      readonly length: number;
      add(output: nbformat.IOutput): number;
      set(index: number, output: nbformat.IOutput): void;
      clear(wait?: boolean): void;
    },
    readonly msgId: string
  ) {}

  /** Take one IOPub message; true once the request is over (its kernel went idle after it). */
  handle(msg: KernelMessage.IIOPubMessage): boolean {
    if ((msg.parent_header as Partial<KernelMessage.IHeader>)?.msg_id !== this.msgId) {
      return false;
    }
    const content = msg.content as any;
    const type = msg.header.msg_type;
    if (type === 'status') {
      return content.execution_state === 'idle';
    }
    if (type === 'clear_output') {
      this.outputs.clear(!!content.wait);
      this.shown.clear();
      return false;
    }
    const displayId: string | undefined = content.transient?.display_id;
    if (type === 'update_display_data') {
      const index = displayId === undefined ? undefined : this.shown.get(displayId);
      if (index !== undefined && index < this.outputs.length) {
        this.outputs.set(index, { output_type: 'display_data', data: content.data, metadata: content.metadata ?? {} });
      }
      return false;
    }
    let output: nbformat.IOutput | null = null;
    if (type === 'display_data') {
      output = { output_type: 'display_data', data: content.data, metadata: content.metadata ?? {} };
    } else if (type === 'execute_result') {
      output = {
        output_type: 'execute_result',
        data: content.data,
        metadata: content.metadata ?? {},
        execution_count: content.execution_count ?? null
      };
    } else if (type === 'stream') {
      output = { output_type: 'stream', name: content.name, text: content.text };
    } else if (type === 'error') {
      output = { output_type: 'error', ename: content.ename, evalue: content.evalue, traceback: content.traceback };
    }
    if (output) {
      this.outputs.add(output);
      if (displayId !== undefined && output.output_type === 'display_data') {
        this.shown.set(displayId, this.outputs.length - 1);
      }
    }
    return false;
  }

  private shown = new Map<string, number>();
}

/** Requests this page shows live, by msg_id. */
const attached = new Map<string, LiveOutputs>();

/** The running cell's notebook, open (opened when it is not), with its kernel connected. */
async function notebookOf(
  cluster: IClusterInfo,
  tracker: INotebookTracker,
  open: OpenNotebook
): Promise<NotebookPanel> {
  const path = cluster.owner.session?.path;
  if (!path) {
    throw new Error('the notebook of the running cell is unknown (its kernel has no notebook session)');
  }
  const panel = tracker.find(p => p.context.path === path) ?? (await open(path));
  if (!panel) {
    throw new Error(`could not open ${path}`);
  }
  await panel.context.ready;
  await panel.sessionContext.ready;
  return panel;
}

/** The cell running ``cell`` in ``panel``, or null when the notebook has no cell of that id. */
function findCell(panel: NotebookPanel, cell: IRunningCell): CodeCell | null {
  const found = panel.content.widgets.find((c: Cell) => c.model.id === cell.cell_id && c.model.type === 'code');
  return (found as CodeCell | undefined) ?? null;
}

/**
 * Show the running cell of ``cluster`` live in its notebook: the cell's old output is replaced by
 * the live dashboard and rank tabs, which the kernel shows again on request.
 */
export async function showLiveView(
  cluster: IClusterInfo,
  tracker: INotebookTracker,
  open: OpenNotebook,
  activate: (panel: NotebookPanel) => void
): Promise<void> {
  const running = cluster.cell;
  if (!running?.msg_id) {
    throw new Error('no cell is running on this cluster');
  }
  const panel = await notebookOf(cluster, tracker, open);
  activate(panel);
  const kernel = panel.sessionContext.session?.kernel;
  if (!kernel || kernel.id !== cluster.owner.kernel_id) {
    throw new Error(`${panel.context.path} is not connected to the kernel running the cell`);
  }
  const cell = findCell(panel, running);
  if (!cell) {
    throw new Error(`${panel.context.path} has no cell ${running.cell_id} (deleted, or the notebook was changed on disk)`);
  }
  void panel.content.scrollToCell(cell);
  // this page ran the cell, or shows it live already: its output is live
  if (attached.has(running.msg_id) || cell.model.executionState === 'running') {
    return;
  }
  const live = new LiveOutputs(cell.model.outputs, running.msg_id);
  attached.set(running.msg_id, live);
  const onMessage = (_: Kernel.IKernelConnection, msg: KernelMessage.IIOPubMessage) => {
    if (live.handle(msg)) {
      finish();
    }
  };
  const finish = () => {
    kernel.iopubMessage.disconnect(onMessage);
    attached.delete(running.msg_id!);
    cell.model.executionState = 'idle';
    if (running.execution_count !== null) {
      cell.model.executionCount = running.execution_count;
    }
  };
  cell.model.outputs.clear(); // the output saved before the cell ran, or part of the way
  cell.model.executionCount = null;
  cell.model.executionState = 'running';
  kernel.iopubMessage.connect(onMessage);
  try {
    await clusterAction(cluster.id, 'attach');
  } catch (err) {
    finish();
    throw err;
  }
}
