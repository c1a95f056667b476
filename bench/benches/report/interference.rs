//! Pure logic of the `--interference` mode: a compute-bound kernel runs on every GPU while
//! broadcasts run beside it, and each path gets its compute slowdown and its broadcast time
//! under load. Medians, slowdowns, the text table, the summary lines, CSV in and out and the
//! bar plot live here; `benches/interference/mod.rs` measures.

use std::io::{self, BufRead, Write};
use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{fmt_num, format_size, path_key, short_num, stats, write_columns, Column, FONT};

/// One path's numbers: medians over the repeats, in milliseconds, every one from the same run.
#[derive(Clone, Debug, PartialEq)]
pub struct InterferenceRow {
    /// Number of GPUs (each runs the compute batch and takes part in the broadcasts).
    pub gpus: usize,
    /// Root rank of the broadcasts.
    pub root: usize,
    /// What broadcast: `nccl`, `p2p`, `copy-engine`, `copy-engine-raw`, ...
    pub path: String,
    /// Bytes per broadcast.
    pub bytes: u64,
    /// Broadcasts back to back per measurement.
    pub broadcasts: usize,
    /// Compute kernel launches per GPU per batch.
    pub launches: usize,
    /// Repeats of each measurement (the medians' sample count).
    pub repeats: usize,
    /// The compute batch alone: time until the slowest GPU finished it.
    pub compute_alone_ms: f64,
    /// The compute batch with the broadcasts running beside it.
    pub compute_loaded_ms: f64,
    /// The broadcasts alone: time until the slowest rank finished them.
    pub bcast_alone_ms: f64,
    /// The broadcasts with the compute batch running beside them.
    pub bcast_loaded_ms: f64,
    /// Host wall-clock time of both together, from queueing to the end of everything.
    pub total_ms: f64,
}

/// The median of `samples` (mean of the middle two for an even count); `None` when there are
/// none or any is NaN.
pub fn median(samples: &[f64]) -> Option<f64> {
    stats(samples).map(|s| s.median)
}

/// How much slower `with` is than `alone`, in percent: `(with / alone - 1) * 100` (negative when
/// faster). `None` unless `alone` is positive and both are finite.
pub fn slowdown_pct(with: f64, alone: f64) -> Option<f64> {
    (alone > 0.0 && alone.is_finite() && with.is_finite()).then(|| (with / alone - 1.0) * 100.0)
}

impl InterferenceRow {
    /// The compute batch's slowdown from the broadcasts, in percent.
    pub fn compute_slowdown_pct(&self) -> Option<f64> {
        slowdown_pct(self.compute_loaded_ms, self.compute_alone_ms)
    }

    /// The broadcasts' slowdown from the compute batch, in percent.
    pub fn bcast_slowdown_pct(&self) -> Option<f64> {
        slowdown_pct(self.bcast_loaded_ms, self.bcast_alone_ms)
    }

    /// Effective bandwidth of the broadcasts under load, GB/s (1e9 bytes per second):
    /// `bytes * broadcasts / bcast_loaded_ms`. `None` unless that time is positive and finite.
    pub fn loaded_gbps(&self) -> Option<f64> {
        let t = self.bcast_loaded_ms;
        (t > 0.0 && t.is_finite()).then(|| self.bytes as f64 * self.broadcasts as f64 / t / 1e6)
    }
}

/// `rows` in table order (nccl, p2p, ... copy-engine, then other paths by name).
fn ordered(rows: &[InterferenceRow]) -> Vec<&InterferenceRow> {
    let mut sorted: Vec<&InterferenceRow> = rows.iter().collect();
    sorted.sort_by(|a, b| path_key(&a.path).cmp(&path_key(&b.path)));
    sorted
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
}

/// The text table of `rows`, in the style of the broadcast table: a title line from the first
/// row (GPUs, broadcasts and their size, root, compute launches, repeats), a line of groups, the
/// column names and units, then one line per path (in table order): `path`; `compute` alone,
/// loaded (ms), slowdown (%); `broadcasts` alone, loaded (ms), slowdown (%), loaded bw (GB/s);
/// `both` total (ms, wall clock). Times have two decimals, percentages and GB/s one; missing
/// values print as `-`. Empty input gives an empty string.
pub fn format_interference_table(rows: &[InterferenceRow]) -> String {
    let Some(first) = rows.first() else {
        return String::new();
    };
    let rows = ordered(rows);
    let col =
        |group: &str, name: &str, unit: &str, f: &dyn Fn(&InterferenceRow) -> String| Column {
            group: group.into(),
            name: name.into(),
            unit: unit.into(),
            cells: rows.iter().map(|r| f(r)).collect(),
        };
    let cols = [
        col("", "path", "", &|r| r.path.clone()),
        col("compute", "alone", "(ms)", &|r| fmt_num(r.compute_alone_ms)),
        col("compute", "loaded", "(ms)", &|r| {
            fmt_num(r.compute_loaded_ms)
        }),
        col("compute", "slowdown", "(%)", &|r| {
            fmt_opt(r.compute_slowdown_pct(), 1)
        }),
        col("broadcasts", "alone", "(ms)", &|r| {
            fmt_num(r.bcast_alone_ms)
        }),
        col("broadcasts", "loaded", "(ms)", &|r| {
            fmt_num(r.bcast_loaded_ms)
        }),
        col("broadcasts", "slowdown", "(%)", &|r| {
            fmt_opt(r.bcast_slowdown_pct(), 1)
        }),
        col("broadcasts", "loaded bw", "(GB/s)", &|r| {
            fmt_opt(r.loaded_gbps(), 1)
        }),
        col("both", "total", "(ms)", &|r| fmt_num(r.total_ms)),
    ];
    let mut out = format!(
        "# interference: {} GPUs, {} x {} broadcasts from root {}, {} compute launches per GPU, \
         medians of {}\n",
        first.gpus,
        first.broadcasts,
        format_size(first.bytes),
        first.root,
        first.launches,
        first.repeats
    );
    write_columns(&mut out, &cols, rows.len());
    out
}

/// One line per row (in table order) comparing its compute slowdown with NCCL's and the P2P
/// kernel's: `copy-engine: compute slowdown 8.8% (NCCL 19.3%, P2P 25.0%) -> 0.46x NCCL's;
/// broadcasts 1.8% slower (386.2 GB/s under load)`. The ratio is `-` when NCCL's slowdown is
/// missing or not positive; a missing NCCL or P2P row drops its part of the parenthesis.
pub fn interference_summary(rows: &[InterferenceRow]) -> Vec<String> {
    let of = |path: &str| {
        rows.iter()
            .find(|r| r.path == path)
            .and_then(InterferenceRow::compute_slowdown_pct)
    };
    let (nccl, p2p) = (of("nccl"), of("p2p"));
    let pct = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}%"));
    let refs: Vec<String> = [("NCCL", nccl), ("P2P", p2p)]
        .into_iter()
        .filter_map(|(name, v)| v.map(|v| format!("{name} {v:.1}%")))
        .collect();
    let refs = if refs.is_empty() {
        String::new()
    } else {
        format!(" ({})", refs.join(", "))
    };
    ordered(rows)
        .into_iter()
        .map(|r| {
            let own = r.compute_slowdown_pct();
            let ratio = match (own, nccl) {
                (Some(o), Some(n)) if n > 0.0 => format!("{:.2}x", o / n),
                _ => "-".to_string(),
            };
            format!(
                "{}: compute slowdown {}{refs} -> {ratio} NCCL's; broadcasts {} slower ({} GB/s \
                 under load)",
                r.path,
                pct(own),
                pct(r.bcast_slowdown_pct()),
                fmt_opt(r.loaded_gbps(), 1)
            )
        })
        .collect()
}

/// The CSV header that [`write_interference_csv`] writes. The last three columns are derived
/// (slowdowns and bandwidth) and ignored by [`read_interference_csv`].
pub const INTERFERENCE_CSV_HEADER: &str = "gpus,root,path,bytes,broadcasts,launches,repeats,\
compute_alone_ms,compute_loaded_ms,bcast_alone_ms,bcast_loaded_ms,total_ms,\
compute_slowdown_pct,bcast_slowdown_pct,loaded_gbps";

/// The columns [`read_interference_csv`] needs, in [`InterferenceRow`] field order.
const NEEDED: [&str; 12] = [
    "gpus",
    "root",
    "path",
    "bytes",
    "broadcasts",
    "launches",
    "repeats",
    "compute_alone_ms",
    "compute_loaded_ms",
    "bcast_alone_ms",
    "bcast_loaded_ms",
    "total_ms",
];

/// Writes `rows` as CSV with [`INTERFERENCE_CSV_HEADER`], floats in Rust's shortest round-trip
/// form; a derived value that is missing is an empty field. A path holding a comma, quote or
/// line break is refused with an `InvalidInput` error.
pub fn write_interference_csv(rows: &[InterferenceRow], mut w: impl Write) -> io::Result<()> {
    writeln!(w, "{INTERFERENCE_CSV_HEADER}")?;
    let opt = |v: Option<f64>| v.map(|v| v.to_string()).unwrap_or_default();
    for r in rows {
        if r.path.contains([',', '"', '\n', '\r']) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("CSV field {:?} holds a comma, quote or line break", r.path),
            ));
        }
        writeln!(
            w,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.gpus,
            r.root,
            r.path,
            r.bytes,
            r.broadcasts,
            r.launches,
            r.repeats,
            r.compute_alone_ms,
            r.compute_loaded_ms,
            r.bcast_alone_ms,
            r.bcast_loaded_ms,
            r.total_ms,
            opt(r.compute_slowdown_pct()),
            opt(r.bcast_slowdown_pct()),
            opt(r.loaded_gbps())
        )?;
    }
    w.flush()
}

/// Reads rows written by [`write_interference_csv`]: the first non-blank line is a header naming
/// at least the measured columns, in any order (others are ignored); blank lines and lines
/// starting with `#` are skipped. An error names the 1-based line number.
pub fn read_interference_csv(r: impl BufRead) -> Result<Vec<InterferenceRow>, String> {
    let mut rows = Vec::new();
    for (lineno, fields) in super::csv_records(r, &NEEDED)? {
        let get = |i: usize| fields[i].as_str();
        let int = |i: usize| {
            get(i)
                .parse::<u64>()
                .map_err(|_| format!("line {lineno}: bad {} {:?}", NEEDED[i], get(i)))
        };
        let size = |i: usize| {
            int(i).and_then(|v| {
                usize::try_from(v).map_err(|_| format!("line {lineno}: {} too large", NEEDED[i]))
            })
        };
        let ms = |i: usize| {
            get(i)
                .parse::<f64>()
                .map_err(|_| format!("line {lineno}: bad {} {:?}", NEEDED[i], get(i)))
        };
        if get(2).is_empty() {
            return Err(format!("line {lineno}: empty path"));
        }
        rows.push(InterferenceRow {
            gpus: size(0)?,
            root: size(1)?,
            path: get(2).to_string(),
            bytes: int(3)?,
            broadcasts: size(4)?,
            launches: size(5)?,
            repeats: size(6)?,
            compute_alone_ms: ms(7)?,
            compute_loaded_ms: ms(8)?,
            bcast_alone_ms: ms(9)?,
            bcast_loaded_ms: ms(10)?,
            total_ms: ms(11)?,
        });
    }
    Ok(rows)
}

/// Width of the PNG written by [`plot_interference`].
pub const INTERFERENCE_PLOT_WIDTH: u32 = 1000;
/// Height of the PNG written by [`plot_interference`].
pub const INTERFERENCE_PLOT_HEIGHT: u32 = 600;
/// Fill of the compute slowdown bars.
pub const COMPUTE_COLOR: RGBColor = RGBColor(31, 119, 180);
/// Fill of the broadcast slowdown bars.
pub const BCAST_COLOR: RGBColor = RGBColor(255, 127, 14);

/// Writes an `INTERFERENCE_PLOT_WIDTH` x `INTERFERENCE_PLOT_HEIGHT` PNG at `path`: one group of
/// two bars per path (in table order), the compute slowdown (%, [`COMPUTE_COLOR`]) and the
/// broadcast slowdown (%, [`BCAST_COLOR`]), each labelled with its value, a line at 0 % and a
/// legend; fonts as in [`super::plot`]. Missing values leave their bar out; empty input gives a
/// plot marked "no data". An error means the file could not be written.
pub fn plot_interference(rows: &[InterferenceRow], path: &Path, title: &str) -> Result<(), String> {
    // As in `plot`: a safety net for plotters' panics.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        plot_inner(rows, path, title)
    })) {
        Ok(result) => result.map_err(|e| format!("plot {}: {e}", path.display())),
        Err(_) => Err(format!("plot {}: plotting panicked", path.display())),
    }
}

fn plot_inner(
    rows: &[InterferenceRow],
    path: &Path,
    title: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT)
        .map_err(|_| "the built-in font does not load")?;
    let rows = ordered(rows);
    let bars: Vec<[Option<f64>; 2]> = rows
        .iter()
        .map(|r| [r.compute_slowdown_pct(), r.bcast_slowdown_pct()])
        .collect();
    let values = bars.iter().flatten().flatten().copied();
    let (lo, hi) = values.fold((0.0f64, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    // Room above (and below) the bars for their labels.
    let pad = ((hi - lo) * 0.12).max(1.0);
    let (y_lo, y_hi) = (if lo < 0.0 { lo - pad } else { 0.0 }, hi + pad);
    let groups = rows.len().max(1) as f64;

    let root = BitMapBackend::new(path, (INTERFERENCE_PLOT_WIDTH, INTERFERENCE_PLOT_HEIGHT))
        .into_drawing_area();
    root.fill(&WHITE)?;
    let body = root.margin(8, 0, 0, 0).titled(title, (FONT, 26))?;
    let mut chart = ChartBuilder::on(&body)
        .margin_top(5)
        .margin_right(25)
        .margin_left(10)
        .margin_bottom(10)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..groups, y_lo..y_hi)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        // The paths are written under their groups below: plotters formats no f64 key points.
        .x_labels(0)
        .bold_line_style(RGBColor(225, 225, 225))
        .axis_style(BLACK)
        .set_all_tick_mark_size(5)
        .y_labels(8)
        .max_light_lines(0)
        .label_style((FONT, 20))
        .axis_desc_style((FONT, 20))
        .y_label_formatter(&|v| short_num(*v))
        .y_desc("slowdown (%)")
        .draw()?;
    chart.draw_series(std::iter::once(PathElement::new(
        [(0.0, 0.0), (groups, 0.0)],
        BLACK.stroke_width(1),
    )))?;
    let label = |v: f64| {
        let anchor = if v >= 0.0 { VPos::Bottom } else { VPos::Top };
        TextStyle::from((FONT, 18)).pos(Pos::new(HPos::Center, anchor))
    };
    for (k, (name, color)) in [("compute", COMPUTE_COLOR), ("broadcast", BCAST_COLOR)]
        .into_iter()
        .enumerate()
    {
        let kf = k as f64;
        let drawn: Vec<(f64, f64)> = bars
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b[k].map(|v| (i as f64 + 0.12 + kf * 0.38, v)))
            .collect();
        chart
            .draw_series(
                drawn
                    .iter()
                    .map(|&(x, v)| Rectangle::new([(x, 0.0), (x + 0.38, v)], color.filled())),
            )?
            .label(format!("{name} slowdown (%)"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 7), (x + 24, y + 7)], color.filled()));
        chart.draw_series(
            drawn
                .iter()
                .map(|&(x, v)| Text::new(format!("{v:.1}%"), (x + 0.19, v), label(v))),
        )?;
    }
    let name_style = TextStyle::from((FONT, 20)).pos(Pos::new(HPos::Center, VPos::Top));
    for (i, r) in rows.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, y_lo));
        root.draw_text(&r.path, &name_style, (x, y + 8))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .margin(8)
        .label_font((FONT, 20))
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    if rows.is_empty() {
        let style = TextStyle::from((FONT, 48)).pos(Pos::new(HPos::Center, VPos::Center));
        let (w, h) = root.dim_in_pixel();
        root.draw_text(
            "no data",
            &style,
            (i32::try_from(w / 2)?, i32::try_from(h / 2)?),
        )?;
    }
    root.present()?;
    Ok(())
}
