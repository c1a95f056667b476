//! Pure (no GPU) logic of the broadcast benchmark: measured rows, size sweeps,
//! statistics, the nccl-tests style table, crossover analysis, CSV in and out,
//! headline ratios and the PNG plot; [`interference`] does the same for the
//! `--interference` mode.
//!
//! The bench binary (`benches/broadcast.rs`) includes this file with `mod report;`
//! and the CPU tests (`tests/bench_report.rs`) with a `#[path]` attribute. Each of
//! them uses a different subset of the items, hence the `dead_code` allowance.
//!
//! # Fonts in the plot
//!
//! Plotters' default `ttf` feature loads system fonts through font-kit, which links
//! `libfontconfig` and `libfreetype` and draws no text (or the binary does not start)
//! on a headless machine without them; with neither `ttf` nor `ab_glyph` plotters
//! panics when asked to draw text. So the crate enables plotters' `ab_glyph` feature
//! instead, and [`plot`] registers Ubuntu Light, a TTF whose bytes come from the
//! `epaint_default_fonts` crate (egui's built-in fonts; Ubuntu Font Licence 1.0), as
//! plotters' `sans-serif` family. Every label (title, captions, tick labels, axis
//! titles, legend) goes through plotters' usual APIs and is rasterised in pure Rust,
//! so the PNG, labels included, looks the same on every machine, fonts or not.
//! (Plotters' ab_glyph renderer places each glyph by its advance alone, ignoring its
//! side bearing, so a few letter pairs sit a pixel too close or too far apart.)
#![allow(
    dead_code,
    reason = "the benchmark and tests/bench_report.rs each use a different subset"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::{self, BufRead, Write};
use std::ops::RangeInclusive;
use std::path::Path;
use std::str::FromStr;

use plotters::coord::combinators::WithKeyPoints;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub mod interference;

/// How the broadcasts were issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// Launched one by one from the host.
    Eager,
    /// Captured once into a CUDA graph, then replayed.
    Graph,
    /// One eager call after 10 ms with every GPU idle: what a call costs when nothing else is
    /// in flight (no back-to-back overlap, launch threads asleep, clocks as they are).
    Idle,
}

impl Mode {
    /// Every mode, in table order.
    pub const ALL: [Mode; 3] = [Mode::Eager, Mode::Graph, Mode::Idle];

    /// The lower-case name: `"eager"`, `"graph"` or `"idle"`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Eager => "eager",
            Mode::Graph => "graph",
            Mode::Idle => "idle",
        }
    }

    /// Parses a name (case-insensitive, surrounding blanks ignored): `eager`/`graph`/`idle`.
    pub fn parse(s: &str) -> Option<Mode> {
        let s = s.trim();
        Mode::ALL
            .into_iter()
            .find(|m| s.eq_ignore_ascii_case(m.name()))
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mode::parse(s).ok_or_else(|| format!("unknown mode {s:?} (expected eager, graph or idle)"))
    }
}

/// One measured point: one path, one mode, one message size.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Number of GPUs taking part (root included).
    pub gpus: usize,
    /// Eager launches or graph replays.
    pub mode: Mode,
    /// What was measured: `nccl`, `p2p`, `auto`, `copy-engine`, `launch-floor`,
    /// `torch-comm`, `torch-dist`, ...
    pub path: String,
    /// What actually ran (`p2p-packet`, `p2p-pull`, `nccl`, ...) or `-`.
    pub route: String,
    /// Message size in bytes.
    pub bytes: u64,
    /// Message size in elements of `dtype`.
    pub count: u64,
    /// Element type, gpucast style (`f32`, `bf16`, `u8`, ...).
    pub dtype: String,
    /// Index of the root GPU.
    pub root: usize,
    /// Median time per broadcast, in microseconds.
    pub time_us: f64,
    /// Fastest repeat's time per broadcast, in microseconds.
    pub min_us: f64,
    /// Slowest repeat's time per broadcast, in microseconds.
    pub max_us: f64,
}

impl Row {
    /// Algorithm bandwidth in GB/s (1e9 bytes per second): `bytes / time_us`.
    /// 0.0 when the time is not a positive finite number.
    pub fn algbw_gbps(&self) -> f64 {
        if self.time_us.is_finite() && self.time_us > 0.0 {
            self.bytes as f64 / self.time_us / 1e3
        } else {
            0.0
        }
    }

    /// Bus bandwidth in GB/s. For a broadcast nccl-tests uses a factor of 1, so this
    /// equals [`Row::algbw_gbps`].
    pub fn busbw_gbps(&self) -> f64 {
        self.algbw_gbps()
    }
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// Parses a size: a whole number with an optional binary suffix, case-insensitive:
/// `4096`, `4096B`, `1K`, `1KB`, `64KiB`, `1M`, `1G`, `1T` (all powers of 1024, as in
/// nccl-tests). Blanks around the number are ignored. `None` for anything else,
/// fractions, negatives or values that overflow a `u64`.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if digits == 0 {
        return None;
    }
    let number: u64 = s[..digits].parse().ok()?;
    let suffix = s[digits..].trim().to_ascii_lowercase();
    let unit = match suffix.as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => KIB,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => GIB,
        "t" | "tb" | "tib" => TIB,
        _ => return None,
    };
    number.checked_mul(unit)
}

/// Formats a size the way [`parse_size`] reads it: the largest binary unit that
/// divides it exactly (`1K`, `64K`, `3M`, `1G`, `2T`), else plain bytes (`1536`, `0`).
pub fn format_size(bytes: u64) -> String {
    if bytes == 0 {
        return "0".to_string();
    }
    for (unit, suffix) in [(TIB, "T"), (GIB, "G"), (MIB, "M"), (KIB, "K")] {
        if bytes.is_multiple_of(unit) {
            return format!("{}{}", bytes / unit, suffix);
        }
    }
    bytes.to_string()
}

/// The nccl-tests `-b min -e max -f factor` sweep: `min, min*factor, ...` while the
/// size stays `<= max`. Empty when `min == 0`, `min > max` or `factor < 2`; stops
/// before a product would overflow.
pub fn size_sweep(min: u64, max: u64, factor: u64) -> Vec<u64> {
    if min == 0 || min > max || factor < 2 {
        return Vec::new();
    }
    std::iter::successors(Some(min), |size| size.checked_mul(factor))
        .take_while(|&size| size <= max)
        .collect()
}

/// Summary of repeated measurements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// The median (mean of the middle two for an even count).
    pub median: f64,
    /// The smallest sample.
    pub min: f64,
    /// The largest sample.
    pub max: f64,
    /// The 10th percentile (linear interpolation between ranks).
    pub p10: f64,
    /// The 90th percentile (linear interpolation between ranks).
    pub p90: f64,
    /// The number of samples.
    pub n: usize,
}

/// Statistics of `samples`. `None` when there are no samples or when any sample is
/// NaN (a NaN means a broken measurement, so the whole set is rejected rather than
/// silently skipped). Percentiles interpolate linearly between ranks, like numpy's
/// default, so the median of an even count is the mean of the middle two.
pub fn stats(samples: &[f64]) -> Option<Stats> {
    if samples.is_empty() || samples.iter().any(|s| s.is_nan()) {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    Some(Stats {
        median: quantile(&sorted, 0.5),
        min: sorted[0],
        max: sorted[sorted.len() - 1],
        p10: quantile(&sorted, 0.1),
        p90: quantile(&sorted, 0.9),
        n: sorted.len(),
    })
}

/// Quantile `q` of a sorted, non-empty slice with linear interpolation.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let lo = pos.floor();
    let frac = pos - lo;
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "`pos` lies in [0, len - 1], so the float-to-index cast cannot truncate"
    )]
    let lo = lo as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    if frac == 0.0 {
        sorted[lo]
    } else {
        sorted[lo] + (sorted[hi] - sorted[lo]) * frac
    }
}

/// The paths that the bench and the PyTorch script write, in table order (`raw-nccl` and
/// `torch-symm` come from the one-process-per-GPU bench).
pub const PATH_ORDER: [&str; 10] = [
    "nccl",
    "raw-nccl",
    "p2p",
    "auto",
    "copy-engine",
    "torch-comm",
    "torch-dist",
    "torch-symm",
    "copy-engine-raw",
    "launch-floor",
];

/// Sort key of a path: its index in [`PATH_ORDER`], unknown paths after, by name.
fn path_key(path: &str) -> (usize, &str) {
    let rank = PATH_ORDER
        .iter()
        .position(|p| *p == path)
        .unwrap_or(PATH_ORDER.len());
    (rank, path)
}

/// The distinct paths in `rows`, in table order: [`PATH_ORDER`] first, then any
/// others alphabetically.
pub fn paths_present(rows: &[Row]) -> Vec<String> {
    let mut paths: Vec<&str> = rows
        .iter()
        .map(|r| r.path.as_str())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    paths.sort_by_key(|p| path_key(p));
    paths.into_iter().map(str::to_string).collect()
}

/// The distinct GPU counts in `rows`, ascending.
pub fn gpu_counts(rows: &[Row]) -> Vec<usize> {
    rows.iter()
        .map(|r| r.gpus)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// The rows measured with `gpus` GPUs.
pub fn rows_for_gpus(rows: &[Row], gpus: usize) -> Vec<Row> {
    rows.iter().filter(|r| r.gpus == gpus).cloned().collect()
}

/// Time per op by size for one (GPU count or any, mode, path). The first row of a
/// point wins when the input holds duplicates; times that are not positive finite
/// numbers count as missing.
fn times(rows: &[Row], gpus: Option<usize>, mode: Mode, path: &str) -> BTreeMap<u64, f64> {
    let mut map = BTreeMap::new();
    for r in rows {
        let valid = r.time_us.is_finite() && r.time_us > 0.0;
        if valid && r.mode == mode && r.path == path && gpus.is_none_or(|g| g == r.gpus) {
            map.entry(r.bytes).or_insert(r.time_us);
        }
    }
    map
}

/// Sizes where both paths were measured, ascending, with (fast time, slow time).
fn common(rows: &[Row], gpus: Option<usize>, mode: Mode, a: &str, b: &str) -> Vec<(u64, f64, f64)> {
    let ta = times(rows, gpus, mode, a);
    let tb = times(rows, gpus, mode, b);
    ta.iter()
        .filter_map(|(bytes, t)| tb.get(bytes).map(|u| (*bytes, *t, *u)))
        .collect()
}

/// The size from which `fast` stops winning for good in `mode`: the smallest size S
/// such that at S and at every larger size measured for both paths, `slow` is at least
/// as fast as `fast` (`slow` time <= `fast` time). `None` when `fast` still wins at the
/// largest common size or the paths share no size.
///
/// Rows should come from one GPU count (see [`rows_for_gpus`]); among duplicate
/// points the first row wins, and points whose time is not a positive finite number
/// are left out.
pub fn crossover(rows: &[Row], mode: Mode, fast: &str, slow: &str) -> Option<u64> {
    let points = common(rows, None, mode, fast, slow);
    let mut cross = None;
    for &(bytes, t_fast, t_slow) in points.iter().rev() {
        if t_fast < t_slow {
            break;
        }
        cross = Some(bytes);
    }
    cross
}

/// The largest common size at which `fast` is strictly faster than `slow` in `mode`:
/// the last win before [`crossover`] (the value a size threshold would be set to), or
/// the largest common size when `fast` wins there (then `crossover` is `None`).
/// `None` when `fast` never wins or the paths share no size.
pub fn last_win(rows: &[Row], mode: Mode, fast: &str, slow: &str) -> Option<u64> {
    common(rows, None, mode, fast, slow)
        .iter()
        .rev()
        .find(|(_, t_fast, t_slow)| t_fast < t_slow)
        .map(|(bytes, _, _)| *bytes)
}

/// A text field of the table.
struct Column {
    group: String,
    name: String,
    unit: String,
    cells: Vec<String>,
}

fn fmt_num(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.2}")
    } else {
        "-".to_string()
    }
}

/// An nccl-tests style text table of `rows`.
///
/// One section per (GPU count, mode), eager first; one line per size; columns size,
/// count, type, root, then for each path present (in [`paths_present`] order) its time
/// per op (us), algbw and busbw (GB/s), for every path other than `baseline` its speedup
/// over `baseline` (`baseline time / path time`, as `2.51x`), and a `route` column for
/// paths whose rows name routes other than themselves (`auto`, `p2p`). Speedup columns
/// are left out of a section without the baseline path. Missing points print as `-`.
pub fn format_table(rows: &[Row], baseline: &str) -> String {
    let mut out = String::new();
    let sections: BTreeSet<(usize, Mode)> = rows.iter().map(|r| (r.gpus, r.mode)).collect();
    for (gpus, mode) in sections {
        let section: Vec<Row> = rows
            .iter()
            .filter(|r| r.gpus == gpus && r.mode == mode)
            .cloned()
            .collect();
        if !out.is_empty() {
            out.push('\n');
        }
        format_section(&mut out, &section, gpus, mode, baseline);
    }
    out
}

fn format_section(out: &mut String, rows: &[Row], gpus: usize, mode: Mode, baseline: &str) {
    let paths = paths_present(rows);
    let sizes: Vec<u64> = rows
        .iter()
        .map(|r| r.bytes)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let has_baseline = paths.iter().any(|p| p == baseline);
    // First row of each (path, bytes).
    let mut points: BTreeMap<(&str, u64), &Row> = BTreeMap::new();
    for r in rows {
        points.entry((r.path.as_str(), r.bytes)).or_insert(r);
    }
    let point = |path: &str, bytes: u64| points.get(&(path, bytes)).copied();
    // Count, type and root from the first path (in table order) measured at the size.
    let first = |bytes: u64| paths.iter().find_map(|p| point(p, bytes));

    let mut cols = vec![
        Column {
            group: String::new(),
            name: "size".into(),
            unit: "(B)".into(),
            cells: sizes.iter().map(|&b| format_size(b)).collect(),
        },
        Column {
            group: String::new(),
            name: "count".into(),
            unit: "(elems)".into(),
            cells: sizes
                .iter()
                .map(|&b| first(b).map_or("-".into(), |r| r.count.to_string()))
                .collect(),
        },
        Column {
            group: String::new(),
            name: "type".into(),
            unit: String::new(),
            cells: sizes
                .iter()
                .map(|&b| first(b).map_or("-".into(), |r| r.dtype.clone()))
                .collect(),
        },
        Column {
            group: String::new(),
            name: "root".into(),
            unit: String::new(),
            cells: sizes
                .iter()
                .map(|&b| first(b).map_or("-".into(), |r| r.root.to_string()))
                .collect(),
        },
    ];
    for path in &paths {
        let cell = |f: &dyn Fn(&Row) -> String| -> Vec<String> {
            sizes
                .iter()
                .map(|&b| point(path, b).map_or("-".into(), f))
                .collect()
        };
        let mut push = |name: &str, unit: &str, cells: Vec<String>| {
            cols.push(Column {
                group: path.clone(),
                name: name.into(),
                unit: unit.into(),
                cells,
            })
        };
        push("time", "(us)", cell(&|r| fmt_num(r.time_us)));
        push("algbw", "(GB/s)", cell(&|r| fmt_num(r.algbw_gbps())));
        push("busbw", "(GB/s)", cell(&|r| fmt_num(r.busbw_gbps())));
        if has_baseline && path != baseline {
            let cells = sizes
                .iter()
                .map(|&b| match (point(baseline, b), point(path, b)) {
                    (Some(base), Some(r)) if r.time_us > 0.0 && base.time_us.is_finite() => {
                        let speedup = base.time_us / r.time_us;
                        if speedup.is_finite() {
                            format!("{speedup:.2}x")
                        } else {
                            "-".into()
                        }
                    }
                    _ => "-".into(),
                })
                .collect();
            push(&format!("vs {baseline}"), "(x)", cells);
        }
        let routed = rows
            .iter()
            .any(|r| &r.path == path && r.route != "-" && r.route != *path && !r.route.is_empty());
        if routed {
            push("route", "", cell(&|r| r.route.clone()));
        }
    }

    out.push_str(&format!(
        "# gpus: {gpus}  mode: {mode}  baseline: {}\n",
        if has_baseline { baseline } else { "(absent)" }
    ));
    write_columns(out, &cols, sizes.len());
}

/// Writes `cols` (each with `rows` cells) as aligned text: a line of group names centered over
/// their columns, the names, the units, then one line per row, every field right-aligned.
fn write_columns(out: &mut String, cols: &[Column], rows: usize) {
    let widths: Vec<usize> = cols
        .iter()
        .map(|c| {
            c.cells
                .iter()
                .map(String::len)
                .chain([c.name.len(), c.unit.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    const SEP: &str = "  ";
    // Group line: each path's name centered over its columns, padded with dashes.
    let mut group_line = String::from("#");
    let mut i = 0;
    while i < cols.len() {
        let mut j = i;
        while j < cols.len() && cols[j].group == cols[i].group {
            j += 1;
        }
        let span = widths[i..j].iter().sum::<usize>() + SEP.len() * (j - i - 1);
        group_line.push_str(SEP);
        if cols[i].group.is_empty() {
            group_line.push_str(&" ".repeat(span));
        } else {
            let label = format!(" {} ", cols[i].group);
            if label.len() >= span {
                group_line.push_str(&label[..span.min(label.len())]);
                group_line.push_str(&" ".repeat(span.saturating_sub(label.len())));
            } else {
                let left = (span - label.len()) / 2;
                let right = span - label.len() - left;
                group_line.push_str(&"-".repeat(left));
                group_line.push_str(&label);
                group_line.push_str(&"-".repeat(right));
            }
        }
        i = j;
    }
    out.push_str(group_line.trim_end());
    out.push('\n');
    for (prefix, field) in [("#", 0), ("#", 1)] {
        let mut line = String::from(prefix);
        for (c, w) in cols.iter().zip(&widths) {
            let text = if field == 0 { &c.name } else { &c.unit };
            line.push_str(SEP);
            line.push_str(&format!("{text:>w$}"));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    for row in 0..rows {
        let mut line = String::from(" ");
        for (c, w) in cols.iter().zip(&widths) {
            line.push_str(SEP);
            line.push_str(&format!("{:>w$}", c.cells[row]));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// The CSV header that [`write_csv`] writes and [`read_csv`] expects.
pub const CSV_HEADER: &str =
    "gpus,mode,path,route,bytes,count,dtype,root,time_us,min_us,max_us,algbw_gbps,busbw_gbps";

/// Writes `rows` as CSV with [`CSV_HEADER`]. Floats use Rust's shortest round-trip
/// formatting, so [`read_csv`] gets the same values back. A text field holding a
/// comma, quote or line break is refused with an `InvalidInput` error.
pub fn write_csv(rows: &[Row], mut w: impl Write) -> io::Result<()> {
    writeln!(w, "{CSV_HEADER}")?;
    for r in rows {
        for field in [&r.path, &r.route, &r.dtype] {
            if field.contains([',', '"', '\n', '\r']) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("CSV field {field:?} holds a comma, quote or line break"),
                ));
            }
        }
        writeln!(
            w,
            "{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.gpus,
            r.mode,
            r.path,
            r.route,
            r.bytes,
            r.count,
            r.dtype,
            r.root,
            r.time_us,
            r.min_us,
            r.max_us,
            r.algbw_gbps(),
            r.busbw_gbps()
        )?;
    }
    w.flush()
}

/// Reads rows written by [`write_csv`] (or by `benches/torch_broadcast.py`).
///
/// The first non-blank line must be a header naming at least the columns `gpus, mode,
/// path, route, bytes, count, dtype, root, time_us, min_us, max_us` in any order; other
/// columns (`algbw_gbps`, `busbw_gbps`, unknown ones) are ignored, as bandwidths are
/// recomputed from bytes and time. Blank lines and lines starting with `#` are skipped.
/// An error names the 1-based line number.
pub fn read_csv(r: impl BufRead) -> Result<Vec<Row>, String> {
    const NEEDED: [&str; 11] = [
        "gpus", "mode", "path", "route", "bytes", "count", "dtype", "root", "time_us", "min_us",
        "max_us",
    ];
    let mut rows = Vec::new();
    for (lineno, fields) in csv_records(r, &NEEDED)? {
        let get = |i: usize| fields[i].as_str();
        fn num<T: FromStr>(lineno: usize, name: &str, s: &str) -> Result<T, String> {
            s.parse()
                .map_err(|_| format!("line {lineno}: bad {name} {s:?}"))
        }
        let text = |i: usize| -> Result<String, String> {
            let s = get(i);
            if s.is_empty() {
                Err(format!("line {lineno}: empty {}", NEEDED[i]))
            } else {
                Ok(s.to_string())
            }
        };
        rows.push(Row {
            gpus: num(lineno, "gpus", get(0))?,
            mode: Mode::parse(get(1))
                .ok_or_else(|| format!("line {lineno}: bad mode {:?}", get(1)))?,
            path: text(2)?,
            route: text(3)?,
            bytes: num(lineno, "bytes", get(4))?,
            count: num(lineno, "count", get(5))?,
            dtype: text(6)?,
            root: num(lineno, "root", get(7))?,
            time_us: num(lineno, "time_us", get(8))?,
            min_us: num(lineno, "min_us", get(9))?,
            max_us: num(lineno, "max_us", get(10))?,
        });
    }
    Ok(rows)
}

/// The data lines of a CSV whose first non-blank line is a header: for each, its 1-based line
/// number and the fields of the columns `needed`, in that order (the header may name them in
/// any order, and other columns). Blank lines and lines starting with `#` are skipped; a line
/// with another number of fields than the header, a header without a needed column, or no
/// header at all is an error naming the line.
pub fn csv_records(r: impl BufRead, needed: &[&str]) -> Result<Vec<(usize, Vec<String>)>, String> {
    let mut index: Option<(Vec<usize>, usize)> = None;
    let mut records = Vec::new();
    for (n, line) in r.lines().enumerate() {
        let lineno = n + 1;
        let line = line.map_err(|e| format!("line {lineno}: {e}"))?;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let Some((idx, width)) = &index else {
            let idx = needed
                .iter()
                .map(|name| {
                    fields
                        .iter()
                        .position(|f| f == name)
                        .ok_or_else(|| format!("line {lineno}: header lacks column {name:?}"))
                })
                .collect::<Result<_, _>>()?;
            index = Some((idx, fields.len()));
            continue;
        };
        if fields.len() != *width {
            return Err(format!(
                "line {lineno}: {} fields, the header has {width}",
                fields.len()
            ));
        }
        records.push((lineno, idx.iter().map(|&i| fields[i].to_string()).collect()));
    }
    if index.is_none() {
        return Err("line 1: no CSV header (empty input)".to_string());
    }
    Ok(records)
}

/// One ratio range as words: `2.60x-3.10x faster (median 2.80x)`. `ratios` are
/// speed ratios (other time / this time), finite and positive, non-empty.
fn describe_ratios(ratios: &[f64]) -> String {
    let Some(s) = stats(ratios) else {
        return "-".to_string();
    };
    let slower = |r: f64| 1.0 / r;
    if s.min >= 1.0 {
        if s.n == 1 || s.min == s.max {
            format!("{:.2}x faster", s.median)
        } else {
            format!(
                "{:.2}x-{:.2}x faster (median {:.2}x)",
                s.min, s.max, s.median
            )
        }
    } else if s.max < 1.0 {
        if s.n == 1 || s.min == s.max {
            format!("{:.2}x slower", slower(s.median))
        } else {
            format!(
                "{:.2}x-{:.2}x slower (median {:.2}x)",
                slower(s.max),
                slower(s.min),
                slower(s.median)
            )
        }
    } else {
        let median = if s.median >= 1.0 {
            format!("{:.2}x faster", s.median)
        } else {
            format!("{:.2}x slower", slower(s.median))
        };
        format!(
            "from {:.2}x slower to {:.2}x faster (median {median})",
            slower(s.min),
            s.max
        )
    }
}

/// Headline ratios for `mode` as human-readable lines.
///
/// For sizes `<= small_max`: `p2p vs nccl`, `auto vs nccl`, `p2p vs torch-comm`,
/// `p2p vs torch-dist`, `p2p vs copy-engine-raw` and `p2p vs launch-floor` (speed ratio
/// `other time / p2p time`, as a range with its median). Over all sizes: `auto vs best
/// of (nccl, p2p)` (and `copy-engine` where measured), the worst `auto time / best time`
/// and its size.
/// Only lines whose paths have common sizes appear. Lines do not name the mode (the
/// caller knows it); with several GPU counts in `rows` each line starts with its count.
/// Example: `<= 64K: p2p vs nccl: 2.60x-3.10x faster (median 2.80x) (7 sizes)`.
pub fn ratio_summary(rows: &[Row], mode: Mode, small_max: u64) -> Vec<String> {
    const PAIRS: [(&str, &str); 6] = [
        ("p2p", "nccl"),
        ("auto", "nccl"),
        ("p2p", "torch-comm"),
        ("p2p", "torch-dist"),
        ("p2p", "copy-engine-raw"),
        ("p2p", "launch-floor"),
    ];
    let counts = gpu_counts(rows);
    let mut lines = Vec::new();
    for &gpus in &counts {
        let prefix = if counts.len() > 1 {
            format!("{gpus} GPUs, ")
        } else {
            String::new()
        };
        for (a, b) in PAIRS {
            let ratios: Vec<f64> = common(rows, Some(gpus), mode, a, b)
                .into_iter()
                .filter(|&(bytes, _, _)| bytes <= small_max)
                .map(|(_, ta, tb)| tb / ta)
                .filter(|r| r.is_finite() && *r > 0.0)
                .collect();
            if ratios.is_empty() {
                continue;
            }
            lines.push(format!(
                "{prefix}<= {}: {a} vs {b}: {} ({} sizes)",
                format_size(small_max),
                describe_ratios(&ratios),
                ratios.len()
            ));
        }
        let auto = times(rows, Some(gpus), mode, "auto");
        let nccl = times(rows, Some(gpus), mode, "nccl");
        let p2p = times(rows, Some(gpus), mode, "p2p");
        let ce = times(rows, Some(gpus), mode, "copy-engine");
        let mut worst: Option<(f64, u64)> = None;
        for (&bytes, &t_auto) in &auto {
            let (Some(&t_nccl), Some(&t_p2p)) = (nccl.get(&bytes), p2p.get(&bytes)) else {
                continue;
            };
            let best = ce
                .get(&bytes)
                .map_or(t_nccl.min(t_p2p), |&t| t.min(t_nccl.min(t_p2p)));
            let ratio = t_auto / best;
            if ratio.is_finite() && worst.is_none_or(|(w, _)| ratio > w) {
                worst = Some((ratio, bytes));
            }
        }
        if let Some((ratio, bytes)) = worst {
            let words = if ratio > 1.0 {
                format!("worst {ratio:.2}x slower at {}", format_size(bytes))
            } else {
                format!(
                    "never slower (worst {ratio:.2}x the time at {})",
                    format_size(bytes)
                )
            };
            let of = if ce.is_empty() {
                "nccl, p2p"
            } else {
                "nccl, p2p, copy-engine"
            };
            lines.push(format!(
                "{prefix}all sizes: auto vs best of ({of}): {words}"
            ));
        }
    }
    lines
}

/// The times of `a` and `b` in `mode` at each size in `range` both have.
fn times_in(
    rows: &[Row],
    mode: Mode,
    a: &str,
    b: &str,
    range: RangeInclusive<u64>,
) -> impl Iterator<Item = (f64, f64)> {
    common(rows, None, mode, a, b)
        .into_iter()
        .filter(move |(bytes, _, _)| range.contains(bytes))
        .map(|(_, ta, tb)| (ta, tb))
}

/// One ratio line for `a` against `b` in `mode` over the common sizes in `range`:
/// `"{label}: {a} vs {b}: {ratios} ({n} sizes)"`, the ratios (speed ratio `b time / a
/// time`) worded as in [`ratio_summary`]. `None` when the paths share no size in `range`.
/// Rows should come from one GPU count.
pub fn ratio_line(
    rows: &[Row],
    mode: Mode,
    a: &str,
    b: &str,
    range: RangeInclusive<u64>,
    label: &str,
) -> Option<String> {
    let ratios: Vec<f64> = times_in(rows, mode, a, b, range.clone())
        .map(|(ta, tb)| tb / ta)
        .filter(|r| r.is_finite() && *r > 0.0)
        .collect();
    if ratios.is_empty() {
        return None;
    }
    let pairs = point_pairs(rows, mode, a, b, range);
    let clear = pairs
        .iter()
        .filter(|(ra, rb)| compare(ra, rb) != Verdict::WithinSpread)
        .count();
    Some(format!(
        "{label}: {a} vs {b}: {} ({} sizes; {clear} of {} sizes outside the spread of the repeats)",
        describe_ratios(&ratios),
        ratios.len(),
        pairs.len()
    ))
}

/// The rows of `a` and `b` in `mode` at each size in `range` both have (the first row of a
/// point wins), by size.
fn point_pairs(
    rows: &[Row],
    mode: Mode,
    a: &str,
    b: &str,
    range: RangeInclusive<u64>,
) -> Vec<(Row, Row)> {
    let first = |path: &str| {
        let mut map: BTreeMap<u64, &Row> = BTreeMap::new();
        for r in rows {
            let valid = r.time_us.is_finite() && r.time_us > 0.0;
            if valid && r.mode == mode && r.path == path && range.contains(&r.bytes) {
                map.entry(r.bytes).or_insert(r);
            }
        }
        map
    };
    let (pa, pb) = (first(a), first(b));
    pa.iter()
        .filter_map(|(bytes, ra)| pb.get(bytes).map(|rb| ((*ra).clone(), (*rb).clone())))
        .collect()
}

/// How one measured point compares with another, given the spread of their repeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every repeat of the first was faster than every repeat of the second.
    Faster,
    /// Every repeat of the first was slower than every repeat of the second.
    Slower,
    /// The repeats overlap (touching ends included): the medians' difference is noise.
    WithinSpread,
}

/// `a` against `b` by the spread (min to max) of their repeats: a difference counts only where
/// the two ranges do not overlap.
pub fn compare(a: &Row, b: &Row) -> Verdict {
    if a.max_us < b.min_us {
        Verdict::Faster
    } else if b.max_us < a.min_us {
        Verdict::Slower
    } else {
        Verdict::WithinSpread
    }
}

/// The headline table in Markdown: gpucast's `path` against the fastest of the NCCL ways `of`
/// (per size and mode, the one with the lowest median; the cell names it), for each mode and
/// each of `sizes` where both were measured. Times below 64 MiB, bus bandwidth from there. A
/// figure is bold only where the repeats of the two do not overlap ([`compare`]); otherwise
/// the ratio says it lies within the spread.
pub fn headline_table(
    rows: &[Row],
    path: &str,
    of: &[&str],
    sizes: &[u64],
    modes: &[Mode],
) -> String {
    const BASE: &str = "fastest-nccl";
    let mut with_best: Vec<Row> = rows.iter().filter(|r| r.path == path).cloned().collect();
    with_best.extend(best_of(rows, BASE, of));
    let mut out = format!(
        "| size, mode | fastest NCCL ({}) | gpucast `{path}` | speed-up |\n|---|---|---|---|\n",
        of.join(", ")
    );
    let figure = |r: &Row| {
        if r.bytes >= 64 << 20 {
            format!("{:.0} GB/s", r.busbw_gbps())
        } else {
            format!("{:.2} us", r.time_us)
        }
    };
    for &mode in modes {
        for &bytes in sizes {
            let Some((mine, base)) = point_pairs(&with_best, mode, path, BASE, bytes..=bytes)
                .into_iter()
                .next()
            else {
                continue;
            };
            let verdict = compare(&mine, &base);
            let bold = |text: String, on: bool| if on { format!("**{text}**") } else { text };
            let ratio = base.time_us / mine.time_us;
            let words = match verdict {
                Verdict::WithinSpread => format!("{ratio:.2}x, within the spread of the repeats"),
                _ => format!("{ratio:.2}x"),
            };
            out.push_str(&format!(
                "| {}, {mode} | {} | {} | {words} |\n",
                format_size(bytes),
                bold(
                    format!("{} ({})", figure(&base), base.route),
                    verdict == Verdict::Slower
                ),
                bold(figure(&mine), verdict == Verdict::Faster),
            ));
        }
    }
    out
}

/// The lines of the call-cost budget: (label, path, the path it is measured against). The
/// first two are absolute times; the others differences of two paths measured in one
/// interleaved run (`nccl-untracked`: cudarc's event tracking off on the contexts;
/// `nccl-nowatch`: the watchdog off; `p2p-untracked`: the P2P call with tracking off).
pub const BUDGET: [(&str, &str, &str); 8] = [
    (
        "launch floor (one empty kernel per rank)",
        "launch-floor",
        "",
    ),
    ("raw ncclBroadcast", "nccl-raw", ""),
    (
        "gpucast's NCCL path over a raw ncclBroadcast",
        "nccl",
        "nccl-raw",
    ),
    (
        "gpucast's own host work (tracking and watchdog off)",
        "nccl-untracked-nowatch",
        "nccl-raw",
    ),
    (
        "cudarc's events (tracking on - off)",
        "nccl",
        "nccl-untracked",
    ),
    ("the watchdog (on - off)", "nccl", "nccl-nowatch"),
    (
        "P2P: cudarc's events (tracking on - off)",
        "p2p",
        "p2p-untracked",
    ),
    (
        "P2P untracked over the launch floor",
        "p2p-untracked",
        "launch-floor",
    ),
];

/// The call-cost budget as a Markdown table: one line per [`BUDGET`] entry, one column per
/// mode; each cell the median over the sizes in `range` (of the time, or of the difference of
/// the two paths' medians at each size), with the range over the sizes; `-` where the paths
/// were not both measured.
pub fn budget_table(rows: &[Row], modes: &[Mode], range: RangeInclusive<u64>) -> String {
    let mut out = String::from("| per call |");
    for m in modes {
        out.push_str(&format!(" {m} |"));
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(modes.len()));
    out.push('\n');
    for (label, a, b) in BUDGET {
        let mut line = format!("| {label} |");
        for &mode in modes {
            let values: Vec<f64> = if b.is_empty() {
                times(rows, None, mode, a)
                    .into_iter()
                    .filter(|(bytes, _)| range.contains(bytes))
                    .map(|(_, t)| t)
                    .collect()
            } else {
                times_in(rows, mode, a, b, range.clone())
                    .map(|(ta, tb)| ta - tb)
                    .collect()
            };
            let cell = match stats(&values) {
                None => "-".to_string(),
                Some(s) => {
                    let median = if b.is_empty() {
                        format!("{:.2} us", s.median)
                    } else {
                        format!("{:+.2} us", s.median)
                    };
                    let (lo, hi) = (format!("{:.2}", s.min), format!("{:.2}", s.max));
                    if lo == hi {
                        median
                    } else {
                        format!("{median} ({lo} to {hi}, {} sizes)", s.n)
                    }
                }
            };
            line.push_str(&format!(" {cell} |"));
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// Where a table or CSV came from: written at its top as `# key: value` lines (which
/// [`read_csv`] skips), one per field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stamp {
    /// The commit the binary was built from (`GPUCAST_COMMIT`, else the build's).
    pub commit: String,
    /// The GPUs, by name and count.
    pub gpu: String,
    /// The driver's version (and the CUDA version it supports).
    pub driver: String,
    /// The NCCL version loaded.
    pub nccl: String,
    /// The command line, quoted for a shell.
    pub command: String,
}

impl Stamp {
    const KEYS: [&'static str; 5] = ["commit", "gpu", "driver", "nccl", "command"];

    fn values(&self) -> [&str; 5] {
        [
            &self.commit,
            &self.gpu,
            &self.driver,
            &self.nccl,
            &self.command,
        ]
    }

    /// The header lines, each ending in a line break; a line break inside a value becomes a
    /// space, so that every value stays on its comment line.
    pub fn header(&self) -> String {
        Stamp::KEYS
            .iter()
            .zip(self.values())
            .map(|(k, v)| format!("# {k}: {}\n", v.replace(['\n', '\r'], " ")))
            .collect()
    }

    /// The stamp at the top of `text` (its leading `#` lines); `None` when a field is missing.
    pub fn parse(text: &str) -> Option<Stamp> {
        let mut fields: BTreeMap<&str, String> = BTreeMap::new();
        for line in text.lines().take_while(|l| l.starts_with('#')) {
            if let Some((k, v)) = line.trim_start_matches('#').trim_start().split_once(": ") {
                fields.entry(k).or_insert_with(|| v.to_string());
            }
        }
        let mut take = |k: &str| fields.remove(k);
        Some(Stamp {
            commit: take("commit")?,
            gpu: take("gpu")?,
            driver: take("driver")?,
            nccl: take("nccl")?,
            command: take("command")?,
        })
    }
}

/// The commit a run reports: `staged` (`GPUCAST_COMMIT`, which ci/gpu-stage.sh writes into
/// .gpu/COMMIT and ci/gpu-run.sh exports: the GPU machine's copy of .git may be stale) when
/// set, else the commit the bench was built from, marked as such, else `unknown`.
pub fn commit_of(staged: Option<&str>, built: Option<&str>) -> String {
    match (staged.map(str::trim).filter(|s| !s.is_empty()), built) {
        (Some(s), _) => s.to_string(),
        (None, Some(b)) if !b.trim().is_empty() => format!("{} (built from)", b.trim()),
        _ => "unknown".to_string(),
    }
}

/// The driver's version from the text of `/proc/driver/nvidia/version`: the first word after
/// `Kernel Module` that looks like a version (digits and dots).
pub fn driver_from_proc(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.contains("Kernel Module"))?;
    let after = &line[line.find("Kernel Module")? + "Kernel Module".len()..];
    after
        .split_whitespace()
        .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map(str::to_string)
}

/// `args` as one line a shell reads back into the same words: words with anything but
/// letters, digits and `-_.,/:=+@%` are single-quoted.
pub fn shell_line(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            let plain = !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.,/:=+@%".contains(c));
            if plain {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Rows of a virtual path `name`: per GPU count, mode and size, the fastest row of the paths
/// `of` (its path name kept as the route), for ratios against the best of several baselines.
pub fn best_of(rows: &[Row], name: &str, of: &[&str]) -> Vec<Row> {
    let mut best: BTreeMap<(usize, Mode, u64), &Row> = BTreeMap::new();
    for r in rows.iter().filter(|r| of.contains(&r.path.as_str())) {
        if !(r.time_us.is_finite() && r.time_us > 0.0) {
            continue;
        }
        let slot = best.entry((r.gpus, r.mode, r.bytes)).or_insert(r);
        if r.time_us < slot.time_us {
            *slot = r;
        }
    }
    best.into_values()
        .map(|r| Row {
            path: name.to_string(),
            route: r.path.clone(),
            ..r.clone()
        })
        .collect()
}

/// `a time - b time` in `mode` over the common sizes in `range`, in microseconds: the cost of
/// what `a` adds to `b` (`"<label>: a - b: +x to +y us (median +z us) (n sizes)"`). `None`
/// when the paths share no size in `range`.
pub fn difference_line(
    rows: &[Row],
    mode: Mode,
    a: &str,
    b: &str,
    range: RangeInclusive<u64>,
    label: &str,
) -> Option<String> {
    let diffs: Vec<f64> = times_in(rows, mode, a, b, range)
        .map(|(ta, tb)| ta - tb)
        .filter(|d| d.is_finite())
        .collect();
    let s = stats(&diffs)?;
    let spread = if s.n == 1 || s.min == s.max {
        format!("{:+.2} us", s.median)
    } else {
        format!(
            "{:+.2} to {:+.2} us (median {:+.2} us)",
            s.min, s.max, s.median
        )
    };
    Some(format!("{label}: {a} - {b}: {spread} ({} sizes)", s.n))
}

/// The largest `a time / b time` in `mode` over the common sizes in `range`, with its size
/// (the first such size on a tie). `None` when the paths share no size in `range`. Rows should
/// come from one GPU count.
pub fn worst_ratio(
    rows: &[Row],
    mode: Mode,
    a: &str,
    b: &str,
    range: RangeInclusive<u64>,
) -> Option<(f64, u64)> {
    let mut worst: Option<(f64, u64)> = None;
    for (bytes, ta, tb) in common(rows, None, mode, a, b) {
        let ratio = ta / tb;
        if range.contains(&bytes) && ratio.is_finite() && worst.is_none_or(|(w, _)| ratio > w) {
            worst = Some((ratio, bytes));
        }
    }
    worst
}

// ---------------------------------------------------------------------------------
// Plot
// ---------------------------------------------------------------------------------

/// Width of the PNG written by [`plot`].
pub const PLOT_WIDTH: u32 = 1600;
/// Height of the PNG written by [`plot`].
pub const PLOT_HEIGHT: u32 = 700;

/// The font family of every label; [`plot`] registers the built-in font under it
/// (see the module docs). It is the family plotters uses by default, so no text can
/// fall back to a font that is not there.
const FONT: &str = "sans-serif";

/// Colors by path, in [`PATH_ORDER`] order, then for other paths.
const PATH_COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),  // nccl: blue
    RGBColor(200, 160, 0),   // raw-nccl: gold
    RGBColor(214, 39, 40),   // p2p: red
    RGBColor(44, 160, 44),   // auto: green
    RGBColor(23, 190, 207),  // copy-engine: cyan
    RGBColor(148, 103, 189), // torch-comm: purple
    RGBColor(255, 127, 14),  // torch-dist: orange
    RGBColor(197, 27, 125),  // torch-symm: magenta
    RGBColor(127, 127, 127), // copy-engine-raw: gray
    RGBColor(30, 30, 30),    // launch-floor: near black
];
const EXTRA_COLORS: [RGBColor; 5] = [
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 128),
];

/// One line of the plot: a (GPU count, path, mode) with its points.
struct Series {
    label: String,
    color: RGBColor,
    mode: Mode,
    path: String,
    /// (bytes, time us, busbw GB/s), by size.
    points: Vec<(f64, f64, f64)>,
}

fn build_series(rows: &[Row]) -> Vec<Series> {
    let paths = paths_present(rows);
    let counts = gpu_counts(rows);
    let mut series = Vec::new();
    for &gpus in &counts {
        for (pi, path) in paths.iter().enumerate() {
            for mode in Mode::ALL {
                let mut pts: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
                for r in rows {
                    let valid = r.bytes > 0 && r.time_us.is_finite() && r.time_us > 0.0;
                    if valid && r.gpus == gpus && r.mode == mode && &r.path == path {
                        pts.entry(r.bytes).or_insert((r.time_us, r.busbw_gbps()));
                    }
                }
                if pts.is_empty() {
                    continue;
                }
                let rank = path_key(path).0;
                let color = if rank < PATH_COLORS.len() {
                    PATH_COLORS[rank]
                } else {
                    EXTRA_COLORS[pi % EXTRA_COLORS.len()]
                };
                let label = if counts.len() > 1 {
                    format!("{path} {mode} {gpus}g")
                } else {
                    format!("{path} {mode}")
                };
                series.push(Series {
                    label,
                    color,
                    mode,
                    path: path.clone(),
                    points: pts
                        .into_iter()
                        .map(|(b, (t, bw))| (b as f64, t, bw))
                        .collect(),
                });
            }
        }
    }
    series
}

/// Short label of a number: `0.5`, `2`, `150`, `2.5`.
fn short_num(v: f64) -> String {
    let s = if v.abs() >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    };
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Smallest and largest of `values`, or `default` when there are none.
fn bounds(values: impl Iterator<Item = f64>, default: (f64, f64)) -> (f64, f64) {
    values
        .fold(None, |acc: Option<(f64, f64)>, v| {
            Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))))
        })
        .unwrap_or(default)
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;
type PlotErr = Box<dyn std::error::Error>;

/// Writes a `PLOT_WIDTH` x `PLOT_HEIGHT` PNG at `path` (its name should end in
/// `.png`): on the left the time per op (us, log scale) against the message size (log
/// scale), on the right the bus bandwidth (GB/s) against the size, one line per (path,
/// mode) (and GPU count, when several), eager solid with filled dots, graph dashed with
/// hollow dots, and a legend. `launch-floor` appears in the time panel only. Text is
/// drawn in a font built into the binary, so no system font is needed (see the module
/// docs). Points with a zero size or a time that is not a positive finite number are
/// left out; empty input gives an empty plot marked "no data", not an error. An error
/// means the file could not be written.
pub fn plot(rows: &[Row], path: &Path, title: &str) -> Result<(), String> {
    // Nothing in `plot_inner` should panic; this is a safety net, as plotters has
    // `panic!`s on some paths.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        plot_inner(rows, path, title)
    })) {
        Ok(result) => result.map_err(|e| format!("plot {}: {e}", path.display())),
        Err(_) => Err(format!("plot {}: plotting panicked", path.display())),
    }
}

fn plot_inner(rows: &[Row], path: &Path, title: &str) -> Result<(), PlotErr> {
    plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT)
        .map_err(|_| "the built-in font does not load")?;
    let series = build_series(rows);
    let root = BitMapBackend::new(path, (PLOT_WIDTH, PLOT_HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let body = root.margin(8, 0, 0, 0).titled(title, (FONT, 28))?;
    let (left, right) = body.split_horizontally(PLOT_WIDTH / 2);

    // x: the size, on a log scale padded by half a power of two on each side; ticks
    // at powers of two, every `step`-th one.
    let (lo, hi) = bounds(
        series.iter().flat_map(|s| s.points.iter().map(|p| p.0)),
        (KIB as f64, MIB as f64),
    );
    let (x_lo, x_hi) = (lo / std::f64::consts::SQRT_2, hi * std::f64::consts::SQRT_2);
    let span = (x_hi / x_lo).log2().max(1.0);
    let step = [1, 2, 3, 4, 5, 10, 16]
        .into_iter()
        .find(|&s| span / f64::from(s) <= 11.0)
        .unwrap_or(16);
    let x_ticks: Vec<f64> = (0..64)
        .filter(|e| e % step == 0)
        .map(|e| (1u64 << e) as f64)
        .filter(|b| (x_lo..=x_hi).contains(b))
        .collect();
    let x_axis = || (x_lo..x_hi).log_scale().with_key_points(x_ticks.clone());

    // Left panel: the time, on a log scale padded by 5% of its decades (at least a
    // tenth of one), ticks at 1, 2, 3, 5 x 10^n for up to two decades, at 1, 2, 5 x
    // 10^n for up to four, else at powers of ten.
    let (y_lo, y_hi) = bounds(
        series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1.log10())),
        (0.0, 3.0),
    );
    let pad = ((y_hi - y_lo) * 0.05).max(0.1);
    let (y_lo, y_hi) = (y_lo - pad, y_hi + pad);
    let decades = y_hi.ceil() - y_lo.floor();
    let mantissas: &[f64] = if decades <= 2.0 {
        &[1.0, 2.0, 3.0, 5.0]
    } else if decades <= 4.0 {
        &[1.0, 2.0, 5.0]
    } else {
        &[1.0]
    };
    let mut y_ticks = Vec::new();
    let mut d = y_lo.floor();
    while d <= y_hi {
        y_ticks.extend(
            mantissas
                .iter()
                .map(|m| m * 10f64.powf(d))
                .filter(|v| (y_lo..=y_hi).contains(&v.log10())),
        );
        d += 1.0;
    }
    let time_lines: Vec<(&Series, Vec<(f64, f64)>)> = series
        .iter()
        .map(|s| (s, s.points.iter().map(|p| (p.0, p.1)).collect()))
        .collect();
    draw_panel(
        &left,
        "time per op (us), log scale",
        "time per op (us)",
        x_axis(),
        (10f64.powf(y_lo)..10f64.powf(y_hi))
            .log_scale()
            .with_key_points(y_ticks),
        &time_lines,
        false,
    )?;

    // Right panel: busbw, linear from 0; plotters puts the ticks at the finest 1, 2 or
    // 5 x 10^n step that gives at most 8 of them. The legend lists every series,
    // launch-floor (not drawn here) included.
    let bw_lines: Vec<(&Series, Vec<(f64, f64)>)> = series
        .iter()
        .map(|s| {
            let pts = s
                .points
                .iter()
                .filter(|p| s.path != "launch-floor" && p.2.is_finite() && p.2 >= 0.0)
                .map(|p| (p.0, p.2))
                .collect();
            (s, pts)
        })
        .collect();
    let bw_max = bw_lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(0.0f64, f64::max);
    let bw_hi = if bw_max > 0.0 { bw_max * 1.08 } else { 1.0 };
    draw_panel(
        &right,
        "bus bandwidth (GB/s)",
        "busbw (GB/s)",
        x_axis(),
        0.0..bw_hi,
        &bw_lines,
        true,
    )?;
    if series.is_empty() {
        let style = TextStyle::from((FONT, 48)).pos(Pos::new(HPos::Center, VPos::Center));
        let (w, h) = root.dim_in_pixel();
        root.draw_text(
            "no data",
            &style,
            (i32::try_from(w / 4)?, i32::try_from(h / 2)?),
        )?;
    }
    root.present()?;
    Ok(())
}

/// Draws one panel: caption, grid at the ticks, frame, tick labels, axis titles,
/// lines and markers, and when `legend` is set a legend of every line.
fn draw_panel<Y>(
    area: &Area<'_>,
    caption: &str,
    y_desc: &str,
    x: WithKeyPoints<LogCoord<f64>>,
    y: Y,
    lines: &[(&Series, Vec<(f64, f64)>)],
    legend: bool,
) -> Result<(), PlotErr>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 24))
        .margin_top(5)
        .margin_right(25)
        .margin_left(10)
        .margin_bottom(10)
        .x_label_area_size(60)
        .y_label_area_size(95)
        .build_cartesian_2d(x, y)?;
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "x ticks are powers of two below 2^64: the cast is exact"
    )]
    let size_label = |b: &f64| format_size(*b as u64);
    chart
        .configure_mesh()
        .bold_line_style(RGBColor(225, 225, 225))
        .axis_style(BLACK)
        .set_all_tick_mark_size(5)
        // Only for the busbw axis: the others bring their own ticks.
        .y_labels(8)
        .max_light_lines(0)
        .label_style((FONT, 20))
        .axis_desc_style((FONT, 20))
        .x_label_formatter(&size_label)
        .y_label_formatter(&|v| short_num(*v))
        .x_desc("message size (bytes)")
        .y_desc(y_desc)
        .draw()?;
    let (xr, yr) = (chart.x_range(), chart.y_range());
    chart.draw_series(std::iter::once(Rectangle::new(
        [(xr.start, yr.start), (xr.end, yr.end)],
        BLACK,
    )))?;

    for (s, pts) in lines {
        let line = s.color.stroke_width(2);
        // Eager: solid line, filled dots; graph: dashed line, hollow dots; idle: dotted line,
        // filled dots.
        let dot = match s.mode {
            Mode::Eager | Mode::Idle => s.color.filled(),
            Mode::Graph => s.color.stroke_width(2),
        };
        let dash = match s.mode {
            Mode::Eager => None,
            Mode::Graph => Some((8, 5)),
            Mode::Idle => Some((2, 4)),
        };
        let anno = match dash {
            None => chart.draw_series(LineSeries::new(pts.iter().copied(), line))?,
            Some((on, off)) => {
                chart.draw_series(DashedLineSeries::new(pts.iter().copied(), on, off, line))?
            }
        };
        if legend {
            // The mark: 40 pixels of the line with a dot in the middle.
            let anno = anno.label(&s.label);
            match dash {
                None => anno.legend(move |p| {
                    EmptyElement::at(p)
                        + PathElement::new([(0, 0), (40, 0)], line)
                        + Circle::new((20, 0), 4, dot)
                }),
                Some((on, off)) => anno.legend(move |p| {
                    EmptyElement::at(p)
                        + DashedPathElement::new([(0, 0), (40, 0)], on, off + 1, line)
                        + Circle::new((20, 0), 4, dot)
                }),
            };
        }
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, dot)))?;
    }
    if legend && !lines.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .margin(8)
            .legend_area_size(52)
            .label_font((FONT, 20))
            .background_style(WHITE)
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}
