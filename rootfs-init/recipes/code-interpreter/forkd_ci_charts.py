"""Rich results for forkd's code interpreter, loaded in each IPython kernel.

install() adds three display formatters to the kernel's shell:

- `e2b/chart`: a matplotlib Figure as the chart E2B's SDKs parse
  (`Result.chart`): its type (line, scatter, bar, pie, superchart for
  several axes, else unknown), title, axis labels, ticks and scales, and the
  data of each element (points, bars, wedges);
- `e2b/data`: a pandas DataFrame as {column: [values]} (`Result.data`);
- `application/json` for plain dicts and lists that are JSON (`Result.json`).

Each formatter looks for its library in sys.modules first, so a cell that
never imported matplotlib or pandas pays nothing for them.
"""

import datetime
import json
import math
import sys


def _num(v):
    """A JSON-safe number or string for a data value."""
    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat()
    if hasattr(v, "item"):  # numpy scalars
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (int, float, str)) or v is None:
        return v
    return str(v)


def _scale(ax, which):
    axis = ax.xaxis if which == "x" else ax.yaxis
    units = getattr(axis, "units", None)
    mod = type(units).__module__ if units is not None else ""
    if mod.startswith("matplotlib.category"):
        return "categorical"
    conv = getattr(axis, "converter", None)
    if conv is not None and "dates" in type(conv).__module__:
        return "datetime"
    return ax.get_xscale() if which == "x" else ax.get_yscale()


def _to_axis_value(ax, which, v):
    """A plotted coordinate as the user gave it: a category name, a date."""
    scale = _scale(ax, which)
    axis = ax.xaxis if which == "x" else ax.yaxis
    if scale == "categorical":
        mapping = getattr(axis.units, "_mapping", {})
        for name, pos in mapping.items():
            if pos == v:
                return str(name)
    if scale == "datetime":
        import matplotlib.dates

        return matplotlib.dates.num2date(v).isoformat()
    return _num(v)


def _ticks(ax, which):
    axis = ax.xaxis if which == "x" else ax.yaxis
    ticks = [_to_axis_value(ax, which, t) for t in axis.get_ticklocs()]
    labels = [t.get_text() for t in axis.get_ticklabels()]
    return ticks, labels


def _base(ax, kind):
    return {
        "type": kind,
        "title": ax.get_title() or None,
        "x_label": ax.get_xlabel() or None,
        "y_label": ax.get_ylabel() or None,
        "x_unit": None,
        "y_unit": None,
        "elements": [],
    }


def _points(ax, kind):
    chart = _base(ax, kind)
    for which in ("x", "y"):
        ticks, labels = _ticks(ax, which)
        chart["%s_ticks" % which] = ticks
        chart["%s_tick_labels" % which] = labels
        chart["%s_scale" % which] = _scale(ax, which)
    return chart


def _kind(ax):
    from matplotlib.collections import PathCollection
    from matplotlib.patches import Rectangle, Wedge

    lines = [ln for ln in ax.lines if ln.get_visible()]
    if ax.patches and all(isinstance(p, Wedge) for p in ax.patches) and not lines:
        return "pie"
    if ax.containers and ax.patches and all(isinstance(p, Rectangle) for p in ax.patches) and not ax.collections:
        return "bar"
    if ax.collections and all(isinstance(c, PathCollection) for c in ax.collections) and not ax.patches and not lines:
        return "scatter"
    if lines and not ax.collections and not ax.patches:
        return "line"
    return "unknown"


def _chart_of_axes(ax):
    kind = _kind(ax)
    if kind == "line":
        chart = _points(ax, "line")
        for ln in ax.lines:
            xs, ys = ln.get_xdata(orig=False), ln.get_ydata(orig=False)
            chart["elements"].append(
                {
                    "label": ln.get_label(),
                    "points": [[_to_axis_value(ax, "x", x), _to_axis_value(ax, "y", y)] for x, y in zip(xs, ys)],
                }
            )
        return chart
    if kind == "scatter":
        chart = _points(ax, "scatter")
        for coll in ax.collections:
            chart["elements"].append(
                {
                    "label": coll.get_label(),
                    "points": [[_to_axis_value(ax, "x", x), _to_axis_value(ax, "y", y)] for x, y in coll.get_offsets()],
                }
            )
        return chart
    if kind == "bar":
        chart = _base(ax, "bar")
        for container in ax.containers:
            group = container.get_label()
            for rect in container:
                horizontal = getattr(container, "orientation", "vertical") == "horizontal"
                if horizontal:
                    at, value, which = rect.get_y() + rect.get_height() / 2, rect.get_width(), "y"
                else:
                    at, value, which = rect.get_x() + rect.get_width() / 2, rect.get_height(), "x"
                chart["elements"].append({"label": str(_to_axis_value(ax, which, at)), "group": group, "value": _num(value)})
        return chart
    if kind == "pie":
        chart = {"type": "pie", "title": ax.get_title() or None, "elements": []}
        for w in ax.patches:
            chart["elements"].append({"label": w.get_label(), "angle": _num(abs(w.theta2 - w.theta1)), "radius": _num(w.r)})
        return chart
    return {"type": "unknown", "title": ax.get_title() or None, "elements": []}


def figure_to_chart(fig):
    """The chart of a matplotlib Figure, or {} for an empty figure."""
    axes = [ax for ax in fig.get_axes() if ax.has_data()]
    if not axes:
        return {}
    if len(axes) == 1:
        return _chart_of_axes(axes[0])
    title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else None
    return {"type": "superchart", "title": title, "elements": [_chart_of_axes(ax) for ax in axes]}


def _chart_formatter(obj):
    if "matplotlib" not in sys.modules:
        return None
    from matplotlib.figure import Figure

    if not isinstance(obj, Figure):
        return None
    try:
        chart = figure_to_chart(obj)
        json.dumps(chart)
        return chart or None
    except Exception:  # noqa: BLE001 (a chart we cannot read: no chart, the PNG stays)
        return None


def _data_formatter(obj):
    pandas = sys.modules.get("pandas")
    if pandas is None or not isinstance(obj, pandas.DataFrame):
        return None
    data = obj.to_dict(orient="list")
    return {str(k): [_num(v) for v in vs] for k, vs in data.items()}


def _json_formatter(obj):
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError):
        return None


class _Formatter:
    """Builds an IPython formatter for one mime type calling `fn`."""

    @staticmethod
    def make(ip, mime, fn):
        from IPython.core.formatters import BaseFormatter
        from traitlets import ObjectName, Unicode

        class F(BaseFormatter):
            format_type = Unicode(mime)
            print_method = ObjectName("_repr_forkd_none_")
            _return_type = (dict, list)

            def __call__(self, obj):
                r = fn(obj)
                return r if r is not None else super().__call__(obj)

        return F(parent=ip.display_formatter)


def install(ip=None):
    """Adds the formatters to the running IPython shell."""
    if ip is None:
        ip = get_ipython()  # noqa: F821 (defined in a kernel)
    fmt = ip.display_formatter
    fmt.formatters["e2b/chart"] = _Formatter.make(ip, "e2b/chart", _chart_formatter)
    fmt.formatters["e2b/data"] = _Formatter.make(ip, "e2b/data", _data_formatter)
    js = fmt.formatters["application/json"]
    js.for_type(dict, _json_formatter)
    js.for_type(list, _json_formatter)
    for mime in ("e2b/chart", "e2b/data"):
        if mime not in fmt.active_types:
            fmt.active_types.append(mime)
