import { readLiveTabs, staticDashboardHtml, staticTabsHtml } from '../src/cutoff';

// The DOM of a live ipywidgets Tab with the class jr-rank-tabs, as JupyterLab renders it.
function liveTabs(): HTMLElement {
  const node = document.createElement('div');
  node.innerHTML =
    '<div class="lm-Widget jupyter-widgets widget-tab jr-rank-tabs">' +
    '<ul class="lm-TabBar-content">' +
    '<li class="lm-TabBar-tab"><div class="lm-TabBar-tabLabel">all ranks</div></li>' +
    '<li class="lm-TabBar-tab lm-mod-current"><div class="lm-TabBar-tabLabel">rank 0</div></li>' +
    '<li class="lm-TabBar-tab"><div class="lm-TabBar-tabLabel">rank 1 ✗</div></li></ul>' +
    '<div class="widget-tab-contents">' +
    '<div class="widget-output"><div class="jp-OutputArea"><div class="jp-OutputPrompt"></div><div class="jp-OutputArea-output"><pre>[rank 0] a &lt;b&gt;\n[rank 1] c\n</pre></div></div></div>' +
    '<div class="widget-output"><div class="jp-OutputArea"><div class="jp-OutputPrompt"></div><div class="jp-OutputArea-output"><pre>a &lt;b&gt;\n</pre></div></div></div>' +
    '<div class="widget-output lm-mod-hidden"><div class="jp-OutputArea"><div class="jp-OutputPrompt"></div><div class="jp-OutputArea-output"><pre>c\n</pre></div></div></div>' +
    '</div></div>';
  return node;
}

describe('a cell cut off by a kernel restart', () => {
  it('reads the live tabs: titles, the selected tab, each pane', () => {
    const live = readLiveTabs(liveTabs())!;
    expect(live.titles).toEqual(['all ranks', 'rank 0', 'rank 1 ✗']);
    expect(live.selected).toBe(1);
    expect(live.panes.map(p => p.text)).toEqual(['[rank 0] a <b>\n[rank 1] c', 'a <b>', 'c']);
    expect(live.panes[1].html).toBe('<div class="jp-OutputArea-output"><pre>a &lt;b&gt;\n</pre></div>');
    expect(readLiveTabs(document.createElement('div'))).toBeNull();
  });

  it('writes static tabs with the same titles and panes, the selected one shown, and the note', () => {
    const node = document.createElement('div');
    node.innerHTML = staticTabsHtml(readLiveTabs(liveTabs())!, '(cut off: the kernel <x>)', 'jrtest');
    const tabs = node.querySelector('#jrtest.jr-rank-tabs')!;
    expect(Array.from(tabs.querySelectorAll('label')).map(l => l.textContent)).toEqual([
      'all ranks',
      'rank 0',
      'rank 1 ✗'
    ]);
    const radios = Array.from(tabs.querySelectorAll('input')) as HTMLInputElement[];
    expect(radios.map(r => r.checked)).toEqual([false, true, false]);
    expect(Array.from(tabs.querySelectorAll('.jr-panel')).map(p => p.textContent)).toEqual([
      '[rank 0] a <b>\n[rank 1] c\n',
      'a <b>\n',
      'c\n'
    ]);
    expect(tabs.querySelector('.jr-note')!.textContent).toBe('(cut off: the kernel <x>)');
    expect(tabs.querySelector('style')!.textContent).toContain('nth-of-type(3):checked~.jr-panel:nth-of-type(3)');
  });

  it('writes the live dashboard as it shows, without its buttons or the hidden chart, and the note', () => {
    const node = document.createElement('div');
    node.innerHTML =
      '<div class="lm-Widget jupyter-widgets widget-vbox jr-dash jr-dashboard">' +
      '<div class="widget-html"><div class="widget-html-content"><b>training</b></div></div>' +
      '<div class="widget-vbox"><div class="jr-row">rank 0: step 17 of 40</div></div>' +
      '<div class="widget-toggle-buttons jr-scale"><button>linear</button><button>log</button></div>' +
      '<div class="widget-stack">' +
      '<div class="widget-html"><svg class="jr-chart-linear"></svg></div>' +
      '<div class="widget-html lm-mod-hidden"><svg class="jr-chart-log"></svg></div></div>' +
      '</div>';
    const out = document.createElement('div');
    out.innerHTML = staticDashboardHtml(node, '(cut off: <restart>)')!;
    const dash = out.querySelector('.jr-dashboard.jr-cut-off')!;
    expect(dash.textContent).toContain('rank 0: step 17 of 40');
    expect(dash.querySelector('.jr-chart-linear')).not.toBeNull();
    expect(dash.querySelector('.jr-chart-log')).toBeNull();
    expect(dash.querySelector('.jr-scale')).toBeNull();
    expect(dash.querySelector('button')).toBeNull();
    expect(dash.querySelector('.jr-note')!.textContent).toBe('(cut off: <restart>)');
    expect(node.querySelector('.jr-scale')).not.toBeNull(); // the live DOM itself is untouched
    expect(staticDashboardHtml(document.createElement('div'), 'x')).toBeNull();
  });
});
