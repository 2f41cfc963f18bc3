/**
 * A ``%%distributed`` cell cut off by a kernel restart: its live rank tabs (an ipywidgets Tab,
 * ``.jr-rank-tabs``) and its live dashboard (an ipywidgets VBox, ``.jr-dashboard``) become static
 * output with a note, instead of disconnected widgets with broken-link icons.
 *
 * The kernel cannot do it: when the restart comes from this page, JupyterLab drops every message
 * of the old kernel before it sends the restart (``KernelConnection.restart`` clears its futures
 * and display ids), so the kernel's own ending (static tabs, a note) never arrives. The page still
 * shows what the widget showed; this copies it into the cell's outputs, where it is saved.
 */
import type { Cell, CodeCell } from '@jupyterlab/cells';
import type { NotebookPanel } from '@jupyterlab/notebook';

const WIDGET_MIME = 'application/vnd.jupyter.widget-view+json';

/** What a live rank-tabs widget shows: its tab titles, the selected one, each pane's HTML/text. */
export interface ILiveTabs {
  titles: string[];
  selected: number;
  panes: { html: string; text: string }[];
}

/** Read the live rank tabs in ``node`` (an output's DOM), or null when there are none. */
export function readLiveTabs(node: Element): ILiveTabs | null {
  const tab = node.querySelector('.widget-tab.jr-rank-tabs');
  if (!tab) {
    return null;
  }
  const tabs = Array.from(tab.querySelectorAll('.lm-TabBar-tab'));
  const titles = tabs.map(t => (t.querySelector('.lm-TabBar-tabLabel')?.textContent ?? '').trim());
  const selected = Math.max(0, tabs.findIndex(t => t.classList.contains('lm-mod-current')));
  const panes = Array.from(tab.querySelectorAll('.widget-tab-contents > .widget-output')).map(p => {
    // the rendered outputs, without the output area's (empty) prompts beside them
    const outputs = Array.from(p.querySelectorAll('.jp-OutputArea-output'));
    const html = outputs.length ? outputs.map(o => o.outerHTML).join('') : p.innerHTML;
    const text = outputs.length ? outputs.map(o => o.textContent).join('') : p.textContent;
    return { html, text: (text ?? '').replace(/\n+$/, '') };
  });
  return { titles, selected, panes };
}

function escape(text: string): string {
  return text.replace(/[&<>"]/g, c => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]!);
}

/**
 * The static tabs (radio buttons and CSS, as the kernel writes them at a cell's end) of ``live``,
 * followed by ``note``; ``uid`` names the element (unique in the page).
 */
export function staticTabsHtml(live: ILiveTabs, note: string, uid: string): string {
  const css =
    `#${uid}>input{display:none}` +
    `#${uid}>label{display:inline-block;padding:2px 12px;margin-right:2px;cursor:pointer;` +
    'border:1px solid var(--jp-border-color1,#ccc);border-bottom:none;border-radius:3px 3px 0 0;' +
    'background:var(--jp-layout-color2,#eee);font-family:var(--jp-ui-font-family,sans-serif);' +
    'font-size:12px}' +
    `#${uid}>input:checked+label{background:var(--jp-layout-color0,#fff);font-weight:600}` +
    `#${uid}>.jr-panel{display:none;border:1px solid var(--jp-border-color1,#ccc);` +
    'padding:4px 6px;max-height:32em;overflow:auto}' +
    live.panes
      .map((_, i) => `#${uid}>input:nth-of-type(${i + 1}):checked~.jr-panel:nth-of-type(${i + 1})`)
      .join(',') +
    '{display:block}' +
    `#${uid}>.jr-note{margin:4px 0 0;white-space:pre-wrap;color:var(--jp-warn-color0,#e65100)}`;
  const parts = [`<div class="jr-rank-tabs jr-cut-off" id="${uid}"><style>${css}</style>`];
  live.titles.forEach((title, i) => {
    const checked = i === live.selected ? ' checked' : '';
    parts.push(
      `<input type="radio" name="${uid}" id="${uid}-${i}"${checked}>` +
        `<label for="${uid}-${i}">${escape(title)}</label>`
    );
  });
  live.panes.forEach(pane => parts.push(`<div class="jr-panel">${pane.html}</div>`));
  parts.push(`<pre class="jr-note">${escape(note)}</pre></div>`);
  return parts.join('');
}

/**
 * The static HTML of a live dashboard in ``node`` (an output's DOM), as it shows now, followed by
 * ``note``; null when there is none. Its parts are plain HTML already (rows, banner, chart as SVG,
 * each carrying its own style); the y-axis buttons (which need the kernel's widget models) and
 * the chart at the scale not shown are left out.
 */
export function staticDashboardHtml(node: Element, note: string): string | null {
  const dash = node.querySelector('.jr-dashboard');
  if (!dash) {
    return null;
  }
  const copy = dash.cloneNode(true) as Element;
  copy.querySelectorAll('.jr-scale').forEach(e => e.remove());
  // ipywidgets' Stack shows its selected child only; the others are hidden by Lumino
  copy.querySelectorAll('.lm-mod-hidden').forEach(e => e.remove());
  copy.querySelectorAll('[style*="display: none"]').forEach(e => e.remove());
  return (
    `<div class="jr-dash jr-dashboard jr-cut-off">${copy.innerHTML}` +
    '<pre class="jr-note" style="margin:4px 0 0;white-space:pre-wrap;color:var(--jp-warn-color0,#e65100)">' +
    `${escape(note)}</pre></div>`
  );
}

/**
 * Replace every live rank-tabs or dashboard output of ``panel``'s code cells by its static form
 * + ``note``.
 */
export function freezeLiveTabs(panel: NotebookPanel, note: string): number {
  let frozen = 0;
  panel.content.widgets.forEach((cell: Cell) => {
    if (cell.model.type !== 'code') {
      return;
    }
    const area = (cell as CodeCell).outputArea;
    const outputs = area.model;
    for (let i = 0; i < outputs.length; i++) {
      const item = outputs.get(i);
      const view = area.widgets[i];
      if (!(WIDGET_MIME in item.data) || !view) {
        continue;
      }
      const live = readLiveTabs(view.node);
      if (!live) {
        // the dashboard's note is short: the rank tabs below it carry the whole one
        const dashboard = staticDashboardHtml(view.node, note.split(';')[0] + (note.includes(';') ? ')' : ''));
        if (dashboard) {
          outputs.set(i, {
            output_type: 'display_data',
            data: { 'text/html': dashboard, 'text/plain': `(the live dashboard, as it was)\n${note}` },
            metadata: { jupyter_ring: { cut_off: true } }
          });
          frozen++;
        }
        continue;
      }
      const uid = `jr${Math.random().toString(16).slice(2, 14)}`;
      const text = live.panes.length ? live.panes[0].text : '';
      outputs.set(i, {
        output_type: 'display_data',
        data: { 'text/html': staticTabsHtml(live, note, uid), 'text/plain': `${text}\n${note}` },
        metadata: { jupyter_ring: { cut_off: true } }
      });
      frozen++;
    }
  });
  return frozen;
}

/** Freeze ``panel``'s live rank tabs whenever its kernel restarts (by the user or after a death). */
export function watchRestarts(panel: NotebookPanel): void {
  panel.sessionContext.statusChanged.connect((_, status) => {
    if (status === 'restarting' || status === 'autorestarting') {
      const why = status === 'restarting' ? 'the kernel was restarted' : 'the kernel died and was restarted';
      freezeLiveTabs(panel, `(cut off: ${why}; the ranks stopped with it, and their variables are gone)`);
    }
  });
}
