import type * as nbformat from '@jupyterlab/nbformat';
import type { KernelMessage } from '@jupyterlab/services';

import { LiveOutputs } from '../src/livecell';
import { runningCellLabel } from '../src/model';
import { renderClusters } from '../src/render';
import { makeCluster } from './fixtures';

/** An output list as the cell model's: consecutive stream text of one name merged. */
class Outputs {
  items: nbformat.IOutput[] = [];
  get length(): number {
    return this.items.length;
  }
  add(output: nbformat.IOutput): number {
    const last = this.items[this.items.length - 1];
    if (last && output.output_type === 'stream' && last.output_type === 'stream' && last.name === output.name) {
      last.text = String(last.text) + String(output.text);
      return this.items.length;
    }
    this.items.push(output);
    return this.items.length;
  }
  set(index: number, output: nbformat.IOutput): void {
    this.items[index] = output;
  }
  clear(): void {
    this.items = [];
  }
}

function msg(type: string, content: any, parent = 'req-1'): KernelMessage.IIOPubMessage {
  return {
    header: { msg_type: type, msg_id: `m-${Math.random()}` },
    parent_header: { msg_id: parent },
    channel: 'iopub',
    content,
    metadata: {}
  } as any;
}

const RUNNING = { cell_id: 'c-7', msg_id: 'req-1', execution_count: 12, started: 1000, kernel_pid: 42 };

describe('LiveOutputs', () => {
  it('puts the running request\'s outputs in the cell and updates them by display id', () => {
    const outputs = new Outputs();
    const live = new LiveOutputs(outputs, 'req-1');
    const widget = { 'application/vnd.jupyter.widget-view+json': { model_id: 'w1' }, 'text/plain': 'live' };
    expect(live.handle(msg('display_data', { data: widget, metadata: {}, transient: { display_id: 'd1' } }))).toBe(false);
    live.handle(msg('stream', { name: 'stderr', text: 'a note\n' }));
    live.handle(msg('stream', { name: 'stderr', text: 'more\n' }));
    live.handle(msg('display_data', { data: { 'text/plain': 'tabs' }, metadata: {}, transient: { display_id: 'd2' } }));
    // another request's output, and an update of a display this page never showed: not here
    live.handle(msg('stream', { name: 'stdout', text: 'other cell\n' }, 'req-2'));
    live.handle(msg('update_display_data', { data: { 'text/plain': 'x' }, metadata: {}, transient: { display_id: 'dX' } }));
    expect(outputs.items.map(o => o.output_type)).toEqual(['display_data', 'stream', 'display_data']);
    expect(outputs.items[1].text).toBe('a note\nmore\n');
    live.handle(msg('update_display_data', { data: { 'text/html': '<div class="jr-static"></div>' }, metadata: {}, transient: { display_id: 'd1' } }));
    live.handle(msg('update_display_data', { data: { 'text/plain': 'final tabs' }, metadata: {}, transient: { display_id: 'd2' } }));
    expect((outputs.items[0].data as any)['text/html']).toContain('jr-static');
    expect((outputs.items[2].data as any)['text/plain']).toBe('final tabs');
    live.handle(msg('error', { ename: 'DistributedError', evalue: 'rank 1', traceback: ['tb'] }));
    expect(outputs.items[3]).toEqual({ output_type: 'error', ename: 'DistributedError', evalue: 'rank 1', traceback: ['tb'] });
    expect(live.handle(msg('status', { execution_state: 'busy' }))).toBe(false);
    expect(live.handle(msg('status', { execution_state: 'idle' }, 'req-2'))).toBe(false);
    expect(live.handle(msg('status', { execution_state: 'idle' }))).toBe(true);
  });

  it('forgets its displays when the output is cleared', () => {
    const outputs = new Outputs();
    const live = new LiveOutputs(outputs, 'req-1');
    live.handle(msg('display_data', { data: { 'text/plain': 'a' }, metadata: {}, transient: { display_id: 'd1' } }));
    live.handle(msg('clear_output', { wait: false }));
    live.handle(msg('update_display_data', { data: { 'text/plain': 'b' }, metadata: {}, transient: { display_id: 'd1' } }));
    expect(outputs.items).toEqual([]);
  });
});

describe('the running cell in the Ring panel', () => {
  it('names the cell and how long it runs, and offers its live view', () => {
    expect(runningCellLabel(RUNNING, 1185)).toBe('cell [12] running for 3 min 5 s');
    expect(runningCellLabel({ ...RUNNING, execution_count: null }, 1009.6)).toBe('cell running for 10 s');
    const node = document.createElement('div');
    const asked: string[] = [];
    renderClusters(node, [makeCluster({ cell: RUNNING })], { onAction: (c, action) => asked.push(`${c.id} ${action}`) });
    const line = node.querySelector('.jp-RingPanel-cell')!;
    expect(line.querySelector('.jp-RingPanel-cellLabel')!.textContent).toMatch(/^cell \[12\] running for /);
    const show = line.querySelector('button[data-action=live]') as HTMLButtonElement;
    expect(show.textContent).toBe('Show live view');
    expect(show.disabled).toBe(false);
    show.click();
    expect(asked).toEqual(['1795400639-v1wr live']);
  });

  it('shows no running cell between cells, nor on a stopped cluster', () => {
    for (const cluster of [makeCluster(), makeCluster({ cell: null }), makeCluster({ cell: RUNNING, state: 'stopped' })]) {
      const node = document.createElement('div');
      renderClusters(node, [cluster], { onAction: () => undefined });
      expect(node.querySelector('.jp-RingPanel-cell')).toBeNull();
    }
  });
});
