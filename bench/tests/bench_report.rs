//! CPU tests of the benchmark's pure logic (`benches/report/mod.rs`).

// The module allows dead code itself (the bench and these tests use different parts).
#[path = "../benches/report/mod.rs"]
mod report;

use report::{
    best_of, budget_table, commit_of, compare, crossover, difference_line, driver_from_proc,
    format_size, format_table, headline_table, last_win, parse_size, plot, ratio_line,
    ratio_summary, read_csv, shell_line, size_sweep, stats, write_csv, Mode, Row, Stamp, Verdict,
    CSV_HEADER,
};

fn row(path: &str, mode: Mode, bytes: u64, time_us: f64) -> Row {
    Row {
        gpus: 2,
        mode,
        path: path.to_string(),
        route: if path == "auto" {
            if bytes <= 65536 {
                "p2p-packet".into()
            } else {
                "nccl".into()
            }
        } else {
            "-".into()
        },
        bytes,
        count: bytes / 4,
        dtype: "f32".into(),
        root: 0,
        time_us,
        min_us: time_us * 0.9,
        max_us: time_us * 1.1,
    }
}

/// Rows of `path` in `mode` with the given (bytes, time) points.
fn series(path: &str, mode: Mode, points: &[(u64, f64)]) -> Vec<Row> {
    points.iter().map(|&(b, t)| row(path, mode, b, t)).collect()
}

#[test]
fn mode_names_and_parse() {
    assert_eq!(Mode::Eager.name(), "eager");
    assert_eq!(Mode::Graph.name(), "graph");
    assert_eq!(Mode::parse("graph"), Some(Mode::Graph));
    assert_eq!(Mode::parse(" Eager "), Some(Mode::Eager));
    assert_eq!(Mode::parse("lazy"), None);
    assert_eq!("graph".parse::<Mode>(), Ok(Mode::Graph));
    assert!("".parse::<Mode>().is_err());
    assert!(Mode::Eager < Mode::Graph);
}

#[test]
fn parse_sizes() {
    assert_eq!(parse_size("4096"), Some(4096));
    assert_eq!(parse_size("1K"), Some(1024));
    assert_eq!(parse_size("1k"), Some(1024));
    assert_eq!(parse_size("64KiB"), Some(64 << 10));
    assert_eq!(parse_size("64KB"), Some(64 << 10));
    assert_eq!(parse_size("1M"), Some(1 << 20));
    assert_eq!(parse_size("3MiB"), Some(3 << 20));
    assert_eq!(parse_size("1G"), Some(1 << 30));
    assert_eq!(parse_size(" 2g "), Some(2 << 30));
    assert_eq!(parse_size("1T"), Some(1 << 40));
    assert_eq!(parse_size("12B"), Some(12));
    assert_eq!(parse_size("0"), Some(0));
    for bad in [
        "",
        "K",
        "1.5M",
        "-1",
        "1X",
        "1KK",
        "M1",
        "99999999999999999999",
        "16777216T",
    ] {
        assert_eq!(parse_size(bad), None, "{bad:?}");
    }
}

#[test]
fn format_sizes() {
    assert_eq!(format_size(0), "0");
    assert_eq!(format_size(1), "1");
    assert_eq!(format_size(1000), "1000");
    assert_eq!(format_size(1024), "1K");
    assert_eq!(format_size(1536), "1536");
    assert_eq!(format_size(3 << 10), "3K");
    assert_eq!(format_size(64 << 10), "64K");
    assert_eq!(format_size(1 << 20), "1M");
    assert_eq!(format_size(1 << 30), "1G");
    assert_eq!(format_size(1 << 40), "1T");
    // Every formatted size parses back.
    for s in size_sweep(1, 1 << 40, 2)
        .into_iter()
        .chain([1000, 1536, 5 << 20])
    {
        assert_eq!(parse_size(&format_size(s)), Some(s), "{s}");
    }
}

#[test]
fn sweeps() {
    let s = size_sweep(1 << 10, 1 << 30, 2);
    assert_eq!(s.len(), 21);
    assert_eq!(s.first(), Some(&1024));
    assert_eq!(s.last(), Some(&(1 << 30)));
    assert_eq!(size_sweep(1024, 1024, 2), vec![1024]);
    // max is not a power of the factor: stop below it.
    assert_eq!(size_sweep(1, 100, 4), vec![1, 4, 16, 64]);
    assert_eq!(size_sweep(8, 9, 2), vec![8]);
    assert!(size_sweep(0, 1024, 2).is_empty());
    assert!(size_sweep(2048, 1024, 2).is_empty());
    assert!(size_sweep(1, 1024, 1).is_empty());
    assert!(size_sweep(1, 1024, 0).is_empty());
    // No overflow near u64::MAX.
    let big = size_sweep(1 << 62, u64::MAX, 2);
    assert_eq!(big, vec![1 << 62, 1 << 63]);
}

#[test]
fn stats_odd_even_empty() {
    assert!(stats(&[]).is_none());
    assert!(stats(&[1.0, f64::NAN]).is_none());

    let s = stats(&[5.0, 1.0, 3.0]).unwrap();
    assert_eq!(s.median, 3.0);
    assert_eq!(s.min, 1.0);
    assert_eq!(s.max, 5.0);
    assert_eq!(s.n, 3);

    let s = stats(&[4.0, 1.0, 3.0, 2.0]).unwrap();
    assert_eq!(s.median, 2.5);
    assert_eq!(s.min, 1.0);
    assert_eq!(s.max, 4.0);
    assert_eq!(s.n, 4);

    let s = stats(&[7.0]).unwrap();
    assert_eq!(
        (s.median, s.min, s.max, s.p10, s.p90),
        (7.0, 7.0, 7.0, 7.0, 7.0)
    );

    // 0..=10: p10 = 1, p90 = 9 with linear interpolation.
    let samples: Vec<f64> = (0..=10).rev().map(f64::from).collect();
    let s = stats(&samples).unwrap();
    assert!((s.p10 - 1.0).abs() < 1e-12, "{}", s.p10);
    assert!((s.p90 - 9.0).abs() < 1e-12, "{}", s.p90);
    assert_eq!(s.median, 5.0);
}

#[test]
fn bandwidths() {
    let r = row("nccl", Mode::Eager, 1 << 30, 1000.0);
    // 1 GiB in 1 ms = 1073.741824 GB/s.
    assert!((r.algbw_gbps() - 1073.741824).abs() < 1e-9);
    assert_eq!(r.busbw_gbps(), r.algbw_gbps());
    assert_eq!(row("nccl", Mode::Eager, 1024, 0.0).algbw_gbps(), 0.0);
    assert_eq!(row("nccl", Mode::Eager, 1024, f64::NAN).algbw_gbps(), 0.0);
}

const K: u64 = 1024;

#[test]
fn crossover_simple() {
    let mut rows = series(
        "p2p",
        Mode::Eager,
        &[
            (K, 5.0),
            (4 * K, 6.0),
            (16 * K, 9.0),
            (64 * K, 20.0),
            (256 * K, 40.0),
        ],
    );
    rows.extend(series(
        "nccl",
        Mode::Eager,
        &[
            (K, 15.0),
            (4 * K, 15.0),
            (16 * K, 15.0),
            (64 * K, 16.0),
            (256 * K, 25.0),
        ],
    ));
    assert_eq!(crossover(&rows, Mode::Eager, "p2p", "nccl"), Some(64 * K));
    assert_eq!(last_win(&rows, Mode::Eager, "p2p", "nccl"), Some(16 * K));
    // The other way round: nccl loses below 64K, then wins to the largest size, so it
    // never stops winning.
    assert_eq!(crossover(&rows, Mode::Eager, "nccl", "p2p"), None);
    assert_eq!(last_win(&rows, Mode::Eager, "nccl", "p2p"), Some(256 * K));
    // No graph rows.
    assert_eq!(crossover(&rows, Mode::Graph, "p2p", "nccl"), None);
    assert_eq!(last_win(&rows, Mode::Graph, "p2p", "nccl"), None);
    // Unknown path.
    assert_eq!(crossover(&rows, Mode::Eager, "p2p", "torch-dist"), None);
    assert_eq!(crossover(&[], Mode::Eager, "p2p", "nccl"), None);
}

#[test]
fn crossover_ignores_early_losses_and_needs_a_final_loss() {
    // p2p loses at 4K (noise), wins again at 16K and 64K, loses at 256K, wins once more
    // at 1M (noise), then loses at 4M and 16M: it stops winning for good at 4M.
    let p2p = [
        (K, 5.0),
        (4 * K, 16.0),
        (16 * K, 9.0),
        (64 * K, 12.0),
        (256 * K, 40.0),
        (1024 * K, 50.0),
        (4096 * K, 90.0),
        (16384 * K, 300.0),
    ];
    let nccl = [
        (K, 15.0),
        (4 * K, 15.0),
        (16 * K, 15.0),
        (64 * K, 16.0),
        (256 * K, 25.0),
        (1024 * K, 55.0),
        (4096 * K, 80.0),
        (16384 * K, 200.0),
    ];
    let mut rows = series("p2p", Mode::Graph, &p2p);
    rows.extend(series("nccl", Mode::Graph, &nccl));
    assert_eq!(crossover(&rows, Mode::Graph, "p2p", "nccl"), Some(4096 * K));
    assert_eq!(last_win(&rows, Mode::Graph, "p2p", "nccl"), Some(1024 * K));
    assert_eq!(crossover(&rows, Mode::Eager, "p2p", "nccl"), None);

    // A tie counts as "slow is at least as fast".
    let mut tie = series("p2p", Mode::Eager, &[(K, 5.0), (2 * K, 10.0)]);
    tie.extend(series("nccl", Mode::Eager, &[(K, 10.0), (2 * K, 10.0)]));
    assert_eq!(crossover(&tie, Mode::Eager, "p2p", "nccl"), Some(2 * K));
    assert_eq!(last_win(&tie, Mode::Eager, "p2p", "nccl"), Some(K));

    // Winning at the largest common size: no crossover, the last win is that size.
    // Sizes measured for one path only are ignored.
    let mut win = series("p2p", Mode::Eager, &[(K, 5.0), (2 * K, 9.0), (4 * K, 1.0)]);
    win.extend(series(
        "nccl",
        Mode::Eager,
        &[(K, 10.0), (2 * K, 8.0), (8 * K, 1.0)],
    ));
    win.extend(series("nccl", Mode::Eager, &[(4 * K, 3.0)]));
    assert_eq!(crossover(&win, Mode::Eager, "p2p", "nccl"), None);
    assert_eq!(last_win(&win, Mode::Eager, "p2p", "nccl"), Some(4 * K));

    // Never winning: crossover at the smallest common size, no last win.
    assert_eq!(crossover(&win, Mode::Eager, "nccl", "p2p"), Some(4 * K));
    let mut lose = series("p2p", Mode::Eager, &[(K, 20.0), (2 * K, 20.0)]);
    lose.extend(series("nccl", Mode::Eager, &[(K, 10.0), (2 * K, 10.0)]));
    assert_eq!(crossover(&lose, Mode::Eager, "p2p", "nccl"), Some(K));
    assert_eq!(last_win(&lose, Mode::Eager, "p2p", "nccl"), None);
}

fn sample_rows() -> Vec<Row> {
    let mut rows = series(
        "nccl",
        Mode::Eager,
        &[(K, 25.1), (64 * K, 30.0), (1 << 20, 60.0)],
    );
    rows.extend(series(
        "p2p",
        Mode::Eager,
        &[(K, 10.0), (64 * K, 12.0), (1 << 20, 80.0)],
    ));
    rows.extend(series(
        "auto",
        Mode::Eager,
        &[(K, 10.05), (64 * K, 12.1), (1 << 20, 61.0)],
    ));
    rows.extend(series(
        "launch-floor",
        Mode::Eager,
        &[(K, 9.5), (64 * K, 9.5), (1 << 20, 9.5)],
    ));
    // torch-comm misses the 64K point.
    rows.extend(series(
        "torch-comm",
        Mode::Eager,
        &[(K, 50.0), (1 << 20, 90.0)],
    ));
    rows.extend(series("nccl", Mode::Graph, &[(K, 12.0), (64 * K, 18.0)]));
    rows.extend(series("p2p", Mode::Graph, &[(K, 4.0), (64 * K, 7.5)]));
    rows
}

#[test]
fn table() {
    let rows = sample_rows();
    let t = format_table(&rows, "nccl");
    println!("{t}");
    assert!(t.contains("mode: eager"));
    assert!(t.contains("mode: graph"));
    assert!(t.find("mode: eager") < t.find("mode: graph"));
    // Speedups over nccl: 25.1 / 10 = 2.51x, 18 / 7.5 = 2.40x, 30 / 12.1 = 2.48x.
    // (auto at 1K: 25.1 / 10.05 = 2.50x.)
    assert!(t.contains("2.51x"), "{t}");
    assert!(t.contains("2.40x"), "{t}");
    assert!(t.contains("2.48x"), "{t}");
    // nccl is the baseline: no "vs nccl" column under nccl, one under each other path.
    let eager = t.split("mode: graph").next().unwrap();
    assert_eq!(eager.matches("vs nccl").count(), 4, "{eager}");
    // BroadcastPath order: nccl, p2p, auto, torch-comm, launch-floor.
    let group = eager.lines().nth(1).unwrap();
    let pos = |p: &str| {
        group
            .find(&format!(" {p} "))
            .unwrap_or_else(|| panic!("{p} in {group}"))
    };
    assert!(pos("nccl") < pos("p2p"));
    assert!(pos("p2p") < pos("auto"));
    assert!(pos("auto") < pos("torch-comm"));
    assert!(pos("torch-comm") < pos("launch-floor"));
    // auto has a route column showing what ran.
    assert!(eager.contains("route"));
    assert!(eager.contains("p2p-packet"));
    // The 64K line of the eager section: torch-comm's time, bandwidths and speedup are
    // missing ("-"), nccl's time is there.
    let line = eager
        .lines()
        .find(|l| l.trim_start().starts_with("64K"))
        .expect("64K line");
    assert!(line.contains("30.00"), "{line}");
    assert!(
        line.split_whitespace().filter(|c| *c == "-").count() >= 4,
        "{line}"
    );
    // Sizes are in ascending order.
    let sizes: Vec<&str> = eager
        .lines()
        .filter(|l| l.starts_with("  "))
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(sizes, ["1K", "64K", "1M"]);
    // Empty input: empty table, no panic; absent baseline: no speedup columns.
    assert_eq!(format_table(&[], "nccl"), "");
    let t = format_table(&rows, "torch-dist");
    assert!(!t.contains("vs torch-dist"));
    assert!(t.contains("baseline: (absent)"));
}

#[test]
fn table_columns_align() {
    let rows = sample_rows();
    let t = format_table(&rows, "nccl");
    let eager: Vec<&str> = t
        .split("\n\n")
        .next()
        .unwrap()
        .lines()
        .skip(2) // title and group lines
        .collect();
    assert_eq!(eager.len(), 5, "{eager:?}");
    // Column ends (the char index after each field) must match across header and data
    // lines; compare the end of the first "time" column in every line.
    let name_line = eager[0];
    let time_end = name_line.find("time").unwrap() + "time".len();
    for line in &eager[2..] {
        let ch = line.as_bytes()[time_end - 1];
        assert!(ch.is_ascii_digit() || ch == b'-', "misaligned: {line:?}");
        assert_eq!(
            line.as_bytes().get(time_end),
            Some(&b' '),
            "misaligned: {line:?}"
        );
    }
}

#[test]
fn csv_round_trip() {
    let mut rows = sample_rows();
    // Values that need all 17 significant digits, and odd ones.
    rows[0].time_us = 0.1 + 0.2;
    rows[0].min_us = 1.0 / 3.0;
    rows[0].max_us = 123456.78901234567;
    rows[1].time_us = 5e-324;
    rows[2].time_us = 1e300;
    rows[3].route = "p2p-pull".into();
    rows[3].dtype = "bf16".into();
    rows[3].gpus = 8;
    rows[3].root = 7;
    let mut buf = Vec::new();
    write_csv(&rows, &mut buf).unwrap();
    let text = String::from_utf8(buf.clone()).unwrap();
    assert_eq!(text.lines().next(), Some(CSV_HEADER));
    assert_eq!(text.lines().count(), rows.len() + 1);
    let back = read_csv(&buf[..]).unwrap();
    assert_eq!(back, rows);
    assert_eq!(back[0].time_us.to_bits(), (0.1f64 + 0.2).to_bits());
    assert_eq!(back[0].min_us.to_bits(), (1.0f64 / 3.0).to_bits());

    // Empty row list: header only, reads back empty.
    let mut buf = Vec::new();
    write_csv(&[], &mut buf).unwrap();
    assert_eq!(read_csv(&buf[..]).unwrap(), Vec::<Row>::new());
}

#[test]
fn csv_reads_python_style_and_reordered_columns() {
    // Columns in another order, CRLF line ends, a comment, a blank line, Python float
    // spellings; bandwidth columns are ignored (here deliberately wrong).
    let text = "mode,gpus,path,route,bytes,count,dtype,root,time_us,min_us,max_us,algbw_gbps,busbw_gbps,extra\r\n\
                # comment\r\n\
                \r\n\
                graph,2,torch-dist,-,1024,512,bf16,1,1e-05,5.5,12.0,999,999,x\r\n";
    let rows = read_csv(text.as_bytes()).unwrap();
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r.mode, Mode::Graph);
    assert_eq!((r.gpus, r.root, r.bytes, r.count), (2, 1, 1024, 512));
    assert_eq!((r.path.as_str(), r.dtype.as_str()), ("torch-dist", "bf16"));
    assert_eq!(r.time_us, 1e-5);
    assert_eq!(r.max_us, 12.0);
    assert!((r.algbw_gbps() - 1024.0 / 1e-5 / 1e3).abs() < 1e-6);
}

#[test]
fn csv_reads_what_torch_broadcast_py_writes() {
    // benches/torch_broadcast.py writes csv.writer rows with repr() floats.
    let text =
        "gpus,mode,path,route,bytes,count,dtype,root,time_us,min_us,max_us,algbw_gbps,busbw_gbps\n\
                2,eager,torch-dist,-,1024,256,f32,0,32.37,31.5,40.0,0.03163,0.03163\n\
                2,graph,torch-dist,-,1024,256,f32,0,0.30000000000000004,1e-05,3.0,0.5,0.5\n";
    let rows = read_csv(text.as_bytes()).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].time_us.to_bits(), (0.1f64 + 0.2).to_bits());
    assert_eq!(rows[1].min_us, 1e-5);
    assert_eq!(rows[0].route, "-");
    assert_eq!(rows[0].path, "torch-dist");
}

#[test]
fn csv_errors_name_the_line() {
    let good =
        "gpus,mode,path,route,bytes,count,dtype,root,time_us,min_us,max_us,algbw_gbps,busbw_gbps\n\
                2,eager,nccl,nccl,1024,256,f32,0,10,9,11,0.1,0.1\n";
    assert_eq!(read_csv(good.as_bytes()).unwrap().len(), 1);

    let bad_number = format!("{good}2,eager,nccl,nccl,1O24,256,f32,0,10,9,11,0.1,0.1\n");
    let e = read_csv(bad_number.as_bytes()).unwrap_err();
    assert!(e.contains("line 3"), "{e}");
    assert!(e.contains("bytes"), "{e}");

    let bad_mode = format!("{good}\n2,lazy,nccl,nccl,1024,256,f32,0,10,9,11,0.1,0.1\n");
    let e = read_csv(bad_mode.as_bytes()).unwrap_err();
    assert!(e.contains("line 4"), "{e}");
    assert!(e.contains("mode"), "{e}");

    let short = format!("{good}2,eager,nccl\n");
    let e = read_csv(short.as_bytes()).unwrap_err();
    assert!(e.contains("line 3"), "{e}");

    let no_col = "gpus,mode,path\n2,eager,nccl\n";
    let e = read_csv(no_col.as_bytes()).unwrap_err();
    assert!(e.contains("line 1") && e.contains("route"), "{e}");

    assert!(read_csv(&b""[..]).is_err());

    // A comma in a text field cannot be written.
    let mut r = row("nccl", Mode::Eager, 1024, 1.0);
    r.route = "a,b".into();
    assert!(write_csv(&[r], Vec::new()).is_err());
}

#[test]
fn ratios() {
    let rows = sample_rows();
    let lines = ratio_summary(&rows, Mode::Eager, 64 * K);
    for l in &lines {
        println!("{l}");
    }
    let find = |needle: &str| {
        lines
            .iter()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} in {lines:?}"))
            .clone()
    };
    // p2p vs nccl at 1K and 64K: 25.1/10 = 2.51, 30/12 = 2.5.
    let l = find("p2p vs nccl");
    assert!(l.contains("2.50x-2.51x faster"), "{l}");
    assert!(l.contains("(2 sizes)"), "{l}");
    // auto vs nccl: 30/12.1 = 2.48, 25.1/10.05 = 2.50.
    let l = find("auto vs nccl");
    assert!(l.contains("2.48x-2.50x faster"), "{l}");
    // torch-comm only at 1K among small sizes: 50/10 = 5x.
    let l = find("p2p vs torch-comm");
    assert!(l.contains("5.00x faster"), "{l}");
    assert!(l.contains("(1 sizes)"), "{l}");
    // The launch floor is faster: 10/9.5 = 1.05x, 12/9.5 = 1.26x slower.
    let l = find("p2p vs launch-floor");
    assert!(l.contains("1.05x-1.26x slower"), "{l}");
    // auto vs best of: 1.005 at 1K, 1.008 at 64K, worst at 1M: 61/60.
    let l = find("auto vs best of (nccl, p2p)");
    assert!(l.contains("worst 1.02x slower at 1M"), "{l}");
    // No torch-dist rows: no line.
    assert!(!lines.iter().any(|l| l.contains("torch-dist")));
    // A faster copy-engine route at 1M joins the best: auto is then 61/50 = 1.22x slower.
    let mut with_ce = rows.clone();
    with_ce.extend(series("copy-engine", Mode::Eager, &[(1 << 20, 50.0)]));
    let lines = ratio_summary(&with_ce, Mode::Eager, 64 * K);
    let l = lines
        .iter()
        .find(|l| l.contains("auto vs best of (nccl, p2p, copy-engine)"))
        .unwrap_or_else(|| panic!("{lines:?}"));
    assert!(l.contains("worst 1.22x slower at 1M"), "{l}");

    // Graph: only p2p and nccl, and no auto.
    let lines = ratio_summary(&rows, Mode::Graph, 64 * K);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("p2p vs nccl: 2.40x-3.00x faster (median 2.70x)"),
        "{lines:?}"
    );

    // Mixed: faster at one size, slower at another.
    let mut mixed = series("p2p", Mode::Eager, &[(K, 5.0), (2 * K, 20.0)]);
    mixed.extend(series("nccl", Mode::Eager, &[(K, 10.0), (2 * K, 10.0)]));
    let lines = ratio_summary(&mixed, Mode::Eager, 1 << 20);
    assert!(
        lines[0].contains("from 2.00x slower to 2.00x faster"),
        "{lines:?}"
    );

    assert!(ratio_summary(&[], Mode::Eager, 1 << 20).is_empty());
}

#[test]
fn plot_writes_png() {
    let mut rows = sample_rows();
    // A second GPU count and an unknown path must not break anything.
    let mut more = series("custom", Mode::Eager, &[(K, 30.0), (1 << 30, 5000.0)]);
    more[0].gpus = 4;
    rows.extend(more);
    rows.extend(series(
        "torch-dist",
        Mode::Graph,
        &[(K, 30.0), (64 * K, 35.0), (1 << 20, 70.0)],
    ));
    // Odd values are skipped, not fatal.
    rows.push(row("nccl", Mode::Graph, 1 << 20, f64::NAN));
    rows.push(row("p2p", Mode::Graph, 0, 0.0));

    let dir = std::env::temp_dir();
    let pid = std::process::id();
    for (name, rows) in [
        ("full", rows.as_slice()),
        ("empty", &[][..]),
        ("one", &rows[..1]),
    ] {
        let path = dir.join(format!("gpucast-bench-report-{pid}-{name}.png"));
        let _ = std::fs::remove_file(&path);
        plot(rows, &path, "broadcast, 2 GPUs, f32, root 0 (test)").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.len() > 1000, "{name}: {} bytes", bytes.len());
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{name}");
        if std::env::var_os("KEEP_PLOT").is_none() {
            std::fs::remove_file(&path).unwrap();
        } else {
            println!("kept {}", path.display());
        }
    }

    // An unwritable path is an error, not a panic.
    let bad = dir.join(format!("gpucast-no-such-dir-{pid}/x/plot.png"));
    assert!(plot(&rows, &bad, "t").is_err());
}

/// The pixels of `img` in the box `[x0, x1, y0, y1]` (ends excluded).
fn pixels(img: &image::RgbImage, [x0, x1, y0, y1]: [u32; 4]) -> impl Iterator<Item = [u8; 3]> + '_ {
    (y0..y1).flat_map(move |y| (x0..x1).map(move |x| img.get_pixel(x, y).0))
}

/// How many pixels of `img` in `area` are clearly darker than the white background
/// (some channel below half).
fn dark_pixels(img: &image::RgbImage, area: [u32; 4]) -> usize {
    pixels(img, area)
        .filter(|p| p.iter().any(|&c| c < 128))
        .count()
}

#[test]
fn plot_draws_text() {
    let dir = std::env::temp_dir();
    let pid = std::process::id();
    let render = |name: &str, rows: &[Row], title: &str| {
        let path = dir.join(format!("gpucast-bench-report-{pid}-text-{name}.png"));
        plot(rows, &path, title).unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        let img = image::open(&path).unwrap().to_rgb8();
        std::fs::remove_file(&path).unwrap();
        (len, img)
    };
    let rows = sample_rows();
    let (len, titled) = render("titled", &rows, "broadcast, 2 GPUs, f32, root 0 (test)");
    let (_, untitled) = render("untitled", &rows, "");
    assert_eq!(titled.dimensions(), (1600, 700));
    // Anti-aliased text, lines and markers do not compress to a few kilobytes.
    assert!(len > 20_000, "{len} bytes");

    // The title is drawn centered above the panels: the band is blank without it,
    // and holds (nearly) black pixels with it.
    let title_band = [560, 1040, 0, 40];
    assert_eq!(dark_pixels(&untitled, title_band), 0);
    let ink = dark_pixels(&titled, title_band);
    assert!(ink > 300, "{ink} dark pixels in the title band");
    let darkest = pixels(&titled, title_band)
        .map(|p| p.into_iter().max().unwrap())
        .min()
        .unwrap();
    assert!(darkest < 40, "darkest title pixel {darkest}");

    // Below the panels sits only the x-axis title, "message size (bytes)", twice.
    let ink = dark_pixels(&titled, [0, 1600, 655, 700]);
    assert!(ink > 300, "{ink} dark pixels under the panels");

    // Empty input: "no data" in the middle of the left panel.
    let (_, empty) = render("empty", &[], "");
    let ink = dark_pixels(&empty, [300, 500, 320, 380]);
    assert!(ink > 100, "{ink} dark pixels where \"no data\" goes");
}

// ---------------------------------------------------------------------------------
// --interference
// ---------------------------------------------------------------------------------

use report::interference::{
    format_interference_table, interference_summary, median, plot_interference,
    read_interference_csv, slowdown_pct, write_interference_csv, InterferenceRow, BCAST_COLOR,
    COMPUTE_COLOR, INTERFERENCE_CSV_HEADER,
};

/// A row of 20 x 1 GiB broadcasts on 2 GPUs with the given medians (ms): compute alone and
/// loaded, broadcasts alone and loaded, total.
fn irow(path: &str, [ca, cl, ba, bl, total]: [f64; 5]) -> InterferenceRow {
    InterferenceRow {
        gpus: 2,
        root: 0,
        path: path.into(),
        bytes: 1 << 30,
        broadcasts: 20,
        launches: 27,
        repeats: 5,
        compute_alone_ms: ca,
        compute_loaded_ms: cl,
        bcast_alone_ms: ba,
        bcast_loaded_ms: bl,
        total_ms: total,
    }
}

/// Shaped like the PyTorch numbers of the issue (57 ms of matmuls, 55 ms of broadcasts alone),
/// in the order the bench does not sort them.
fn interference_rows() -> Vec<InterferenceRow> {
    vec![
        irow("copy-engine-raw", [57.0, 61.0, 55.5, 56.0, 62.5]),
        irow("copy-engine", [57.0, 62.0, 55.0, 56.0, 63.0]),
        irow("p2p", [56.0, 70.0, 54.0, 65.0, 71.0]),
        irow("nccl", [57.0, 68.0, 55.0, 60.0, 68.5]),
    ]
}

#[test]
fn interference_median_and_slowdown() {
    assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
    assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    assert_eq!(median(&[]), None);
    assert_eq!(median(&[1.0, f64::NAN]), None);

    let s = slowdown_pct(62.0, 57.0).unwrap();
    assert!((s - 8.771_929_824_561_4).abs() < 1e-9, "{s}");
    assert_eq!(slowdown_pct(57.0, 57.0), Some(0.0));
    assert!((slowdown_pct(45.0, 50.0).unwrap() + 10.0).abs() < 1e-9);
    assert_eq!(slowdown_pct(1.0, 0.0), None);
    assert_eq!(slowdown_pct(1.0, -1.0), None);
    assert_eq!(slowdown_pct(f64::NAN, 1.0), None);
    assert_eq!(slowdown_pct(1.0, f64::INFINITY), None);

    let r = irow("nccl", [57.0, 68.0, 55.0, 60.0, 68.5]);
    assert!((r.compute_slowdown_pct().unwrap() - 1100.0 / 57.0).abs() < 1e-9);
    assert!((r.bcast_slowdown_pct().unwrap() - 500.0 / 55.0).abs() < 1e-9);
    // 20 GiB in 60 ms: 21474836480 / 0.06 s = 357.9 GB/s.
    let bw = r.loaded_gbps().unwrap();
    assert!((bw - 357.913_941_333_333).abs() < 1e-6, "{bw}");
    assert_eq!(irow("x", [1.0, 1.0, 1.0, 0.0, 1.0]).loaded_gbps(), None);
}

#[test]
fn interference_table() {
    let t = format_interference_table(&interference_rows());
    println!("{t}");
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 8, "{t}");
    assert_eq!(
        lines[0],
        "# interference: 2 GPUs, 20 x 1G broadcasts from root 0, 27 compute launches per GPU, \
         medians of 5"
    );
    // Groups, then names, then units.
    for g in [" compute ", " broadcasts ", " both"] {
        assert!(lines[1].contains(g), "{}", lines[1]);
    }
    assert!(lines[1].find("compute") < lines[1].find("broadcasts"));
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        [
            "#", "path", "alone", "loaded", "slowdown", "alone", "loaded", "slowdown", "loaded",
            "bw", "total"
        ]
    );
    // Table order: nccl, p2p, copy-engine, then other paths.
    let paths: Vec<&str> = lines[4..]
        .iter()
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(paths, ["nccl", "p2p", "copy-engine", "copy-engine-raw"]);
    // nccl: 68/57 - 1 = 19.3%, 60/55 - 1 = 9.1%, 357.9 GB/s.
    assert_eq!(
        lines[4].split_whitespace().collect::<Vec<_>>(),
        ["nccl", "57.00", "68.00", "19.3", "55.00", "60.00", "9.1", "357.9", "68.50"]
    );
    // copy-engine: 62/57 - 1 = 8.8%, 56/55 - 1 = 1.8%, 383.5 GB/s.
    assert_eq!(
        lines[6].split_whitespace().collect::<Vec<_>>(),
        [
            "copy-engine",
            "57.00",
            "62.00",
            "8.8",
            "55.00",
            "56.00",
            "1.8",
            "383.5",
            "63.00"
        ]
    );
    // Every field is right-aligned: each data line ends where the units line does, and the
    // last column of the names ends there too.
    let end = lines[2].len();
    assert!(lines[3..].iter().all(|l| l.len() == end), "{t}");
    // A compute slowdown column ends under "slowdown" on every line.
    let col_end = lines[2].find("slowdown").unwrap() + "slowdown".len();
    for l in &lines[4..] {
        let b = l.as_bytes();
        assert!(
            b[col_end - 1].is_ascii_digit() && b[col_end] == b' ',
            "{l:?}"
        );
    }
    // Missing values print as "-": no alone time means no slowdown.
    let mut rows = interference_rows();
    rows[3].compute_alone_ms = 0.0;
    rows[3].bcast_loaded_ms = f64::NAN;
    let t = format_interference_table(&rows);
    let nccl = t.lines().nth(4).unwrap();
    assert_eq!(
        nccl.split_whitespace().collect::<Vec<_>>(),
        ["nccl", "0.00", "68.00", "-", "55.00", "-", "-", "-", "68.50"]
    );
    assert_eq!(format_interference_table(&[]), "");
}

#[test]
fn interference_summary_lines() {
    let lines = interference_summary(&interference_rows());
    for l in &lines {
        println!("{l}");
    }
    assert_eq!(lines.len(), 4);
    // 62/57 - 1 = 8.77%; NCCL 19.30%, P2P 70/56 - 1 = 25.0%; 8.77 / 19.30 = 0.45.
    assert_eq!(
        lines[2],
        "copy-engine: compute slowdown 8.8% (NCCL 19.3%, P2P 25.0%) -> 0.45x NCCL's; \
         broadcasts 1.8% slower (383.5 GB/s under load)"
    );
    assert!(lines[0].starts_with("nccl: compute slowdown 19.3% ") && lines[0].contains("1.00x"));
    assert!(lines[1].contains("-> 1.30x NCCL's"), "{}", lines[1]);
    // Without NCCL: no ratio, and only P2P in the parenthesis.
    let rows: Vec<_> = interference_rows()
        .into_iter()
        .filter(|r| r.path != "nccl")
        .collect();
    let lines = interference_summary(&rows);
    assert!(
        lines[1].starts_with("copy-engine: compute slowdown 8.8% (P2P 25.0%) -> - NCCL's;"),
        "{}",
        lines[1]
    );
    // NCCL not slowed down: no ratio either.
    let mut rows = interference_rows();
    rows[3].compute_loaded_ms = 57.0;
    assert!(interference_summary(&rows)[2].contains("(NCCL 0.0%, P2P 25.0%) -> - NCCL's"));
    assert!(interference_summary(&[]).is_empty());
}

#[test]
fn interference_csv_round_trip_and_errors() {
    let mut rows = interference_rows();
    rows[0].total_ms = 0.1 + 0.2;
    rows[1].bcast_alone_ms = 0.0; // derived slowdown missing: an empty field
    let mut buf = Vec::new();
    write_interference_csv(&rows, &mut buf).unwrap();
    let text = String::from_utf8(buf.clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], INTERFERENCE_CSV_HEADER);
    assert_eq!(lines.len(), 5);
    let (measured, derived) = lines[4].split_at(lines[4].find("68.5,").unwrap() + 5);
    assert_eq!(measured, "2,0,nccl,1073741824,20,27,5,57,68,55,60,68.5,");
    let derived: Vec<f64> = derived.split(',').map(|v| v.parse().unwrap()).collect();
    for (got, want) in derived
        .iter()
        .zip([1100.0 / 57.0, 500.0 / 55.0, 357.913_941_333])
    {
        assert!((got - want).abs() < 1e-6, "{got} {want}");
    }
    assert_eq!(derived.len(), 3);
    assert!(lines[2].contains(",,"), "{}", lines[2]);
    let back = read_interference_csv(&buf[..]).unwrap();
    assert_eq!(back, rows);
    assert_eq!(back[0].total_ms.to_bits(), (0.1f64 + 0.2).to_bits());

    // Reordered columns, a comment, CRLF; unknown columns ignored.
    let text = "path,gpus,root,bytes,broadcasts,launches,repeats,compute_alone_ms,\
                compute_loaded_ms,bcast_alone_ms,bcast_loaded_ms,total_ms,x\r\n# c\r\n\
                p2p,4,1,4096,3,2,1,1.5,2,3,4,5,y\r\n";
    let r = &read_interference_csv(text.as_bytes()).unwrap()[0];
    assert_eq!((r.gpus, r.root, r.bytes, r.broadcasts), (4, 1, 4096, 3));
    assert_eq!((r.path.as_str(), r.compute_alone_ms), ("p2p", 1.5));

    let bad = format!("{INTERFERENCE_CSV_HEADER}\n2,0,nccl,1G,20,27,5,1,1,1,1,1,,,\n");
    let e = read_interference_csv(bad.as_bytes()).unwrap_err();
    assert!(e.contains("line 2") && e.contains("bytes"), "{e}");
    let short = format!("{INTERFERENCE_CSV_HEADER}\n\n2,0,nccl\n");
    assert!(read_interference_csv(short.as_bytes())
        .unwrap_err()
        .contains("line 3"));
    let e = read_interference_csv("gpus,root,path\n".as_bytes()).unwrap_err();
    assert!(e.contains("line 1") && e.contains("bytes"), "{e}");
    assert!(read_interference_csv(&b""[..]).is_err());
    let mut r = irow("a,b", [1.0; 5]);
    assert!(write_interference_csv(&[r.clone()], Vec::new()).is_err());
    r.path = "ok".into();
    assert!(write_interference_csv(&[r], Vec::new()).is_ok());
}

#[test]
fn interference_plot() {
    let dir = std::env::temp_dir();
    let pid = std::process::id();
    let render = |name: &str, rows: &[InterferenceRow]| {
        let path = dir.join(format!("gpucast-bench-interference-{pid}-{name}.png"));
        plot_interference(rows, &path, "interference, 2 GPUs, 20 x 1G (test)").unwrap();
        let img = image::open(&path).unwrap().to_rgb8();
        if std::env::var_os("KEEP_PLOT").is_none() {
            std::fs::remove_file(&path).unwrap();
        } else {
            println!("kept {}", path.display());
        }
        img
    };
    let count = |img: &image::RgbImage, c: plotters::style::RGBColor| {
        img.pixels().filter(|p| p.0 == [c.0, c.1, c.2]).count()
    };
    let img = render("full", &interference_rows());
    assert_eq!(img.dimensions(), (1000, 600));
    // Bars of both kinds; compute slowdowns (19.3 + 25.0 + 8.8 + 7.0 = 60.1) outweigh the
    // broadcast ones (9.1 + 20.4 + 1.8 + 0.9 = 32.2) and cover as much more area.
    let (compute, bcast) = (count(&img, COMPUTE_COLOR), count(&img, BCAST_COLOR));
    let ratio = compute as f64 / bcast as f64;
    assert!(
        bcast > 1000 && (1.7..2.0).contains(&ratio),
        "{compute} {bcast}"
    );
    // A negative slowdown draws a bar below the zero line, not nothing.
    let mut rows = interference_rows();
    for r in &mut rows {
        r.compute_loaded_ms = r.compute_alone_ms * 0.9;
        r.bcast_loaded_ms = f64::NAN;
    }
    let img = render("negative", &rows);
    assert!(count(&img, COMPUTE_COLOR) > 1000);
    assert!(count(&img, BCAST_COLOR) < 500); // the legend's mark only
                                             // No rows: "no data" in the middle, no bars.
    let img = render("empty", &[]);
    assert!(count(&img, COMPUTE_COLOR) < 500);
    let dark = dark_pixels(&img, [400, 600, 270, 330]);
    assert!(dark > 100, "{dark} dark pixels where \"no data\" goes");
    // An unwritable path is an error.
    let bad = dir.join(format!("gpucast-no-such-dir-{pid}/x/i.png"));
    assert!(plot_interference(&interference_rows(), &bad, "t").is_err());
}

#[test]
fn idle_mode_is_named_and_parsed() {
    assert_eq!(Mode::Idle.name(), "idle");
    assert_eq!(Mode::parse(" IDLE"), Some(Mode::Idle));
    assert!(Mode::ALL.contains(&Mode::Idle));
}

#[test]
fn differences_in_microseconds() {
    let mut rows = series(
        "nccl",
        Mode::Eager,
        &[(1024, 9.0), (2048, 10.5), (1 << 20, 40.0)],
    );
    rows.extend(series(
        "nccl-raw",
        Mode::Eager,
        &[(1024, 5.0), (2048, 5.5), (1 << 20, 39.0)],
    ));
    assert_eq!(
        difference_line(&rows, Mode::Eager, "nccl", "nccl-raw", 0..=65536, "<= 64K").as_deref(),
        Some("<= 64K: nccl - nccl-raw: +4.00 to +5.00 us (median +4.50 us) (2 sizes)")
    );
    assert_eq!(
        difference_line(&rows, Mode::Graph, "nccl", "nccl-raw", 0..=65536, "<= 64K"),
        None
    );
    let one = difference_line(
        &rows,
        Mode::Eager,
        "nccl-raw",
        "nccl",
        1 << 20..=1 << 20,
        "1M",
    );
    assert_eq!(
        one.as_deref(),
        Some("1M: nccl-raw - nccl: -1.00 us (1 sizes)")
    );
}

#[test]
fn the_fastest_of_several_paths_per_size() {
    let mut rows = series("nccl", Mode::Eager, &[(1024, 9.0), (2048, 10.5)]);
    rows.extend(series(
        "nccl-raw",
        Mode::Eager,
        &[(1024, 5.0), (2048, 12.0)],
    ));
    rows.extend(series("nccl-raw", Mode::Graph, &[(1024, 1.0)]));
    rows.extend(series("p2p", Mode::Eager, &[(1024, 2.0)]));
    let best = best_of(&rows, "nccl-best", &["nccl", "nccl-raw", "nccl-threads"]);
    let got: Vec<(Mode, u64, f64, &str)> = best
        .iter()
        .map(|r| (r.mode, r.bytes, r.time_us, r.route.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            (Mode::Eager, 1024, 5.0, "nccl-raw"),
            (Mode::Eager, 2048, 10.5, "nccl"),
            (Mode::Graph, 1024, 1.0, "nccl-raw"),
        ]
    );
    assert!(best.iter().all(|r| r.path == "nccl-best"));
}

fn spread(path: &str, mode: Mode, bytes: u64, [min, median, max]: [f64; 3]) -> Row {
    Row {
        min_us: min,
        max_us: max,
        ..row(path, mode, bytes, median)
    }
}

#[test]
fn a_difference_counts_only_outside_the_spread_of_the_repeats() {
    let fast = spread("p2p", Mode::Eager, 1024, [5.0, 5.3, 6.0]);
    let slow = spread("nccl", Mode::Eager, 1024, [13.5, 14.0, 15.0]);
    assert_eq!(compare(&fast, &slow), Verdict::Faster);
    assert_eq!(compare(&slow, &fast), Verdict::Slower);
    // 369 against 361 GB/s at 1 GiB: the medians differ, the repeats overlap.
    let a = spread("p2p", Mode::Eager, 1 << 30, [2880.0, 2909.0, 2990.0]);
    let b = spread("nccl", Mode::Eager, 1 << 30, [2900.0, 2977.0, 3010.0]);
    assert_eq!(compare(&a, &b), Verdict::WithinSpread);
    assert_eq!(compare(&b, &a), Verdict::WithinSpread);
    // Touching ends overlap.
    let c = spread("p2p", Mode::Eager, 1024, [4.0, 4.5, 5.0]);
    let d = spread("nccl", Mode::Eager, 1024, [5.0, 5.5, 6.0]);
    assert_eq!(compare(&c, &d), Verdict::WithinSpread);
}

/// The headline names the baseline it beats (the fastest way to drive NCCL at each size, and
/// which one that was), and bolds a gpucast figure only where its repeats and the baseline's do
/// not overlap.
#[test]
fn the_headline_names_its_baseline_and_bolds_only_clear_wins() {
    let ways = ["nccl", "nccl-raw", "nccl-threads"];
    let mut rows = vec![
        spread("nccl", Mode::Eager, 1024, [14.6, 20.2, 21.2]),
        spread("nccl-raw", Mode::Eager, 1024, [13.0, 13.5, 14.0]),
        spread("nccl-threads", Mode::Eager, 1024, [9.0, 9.5, 10.0]),
        spread("p2p", Mode::Eager, 1024, [5.6, 6.1, 6.8]),
        spread("nccl", Mode::Eager, 1 << 30, [2900.0, 2977.0, 3010.0]),
        spread("nccl-raw", Mode::Eager, 1 << 30, [2950.0, 2990.0, 3020.0]),
        spread("p2p", Mode::Eager, 1 << 30, [2880.0, 2909.0, 2990.0]),
    ];
    rows.push(spread("p2p", Mode::Graph, 1024, [2.6, 2.7, 2.9]));
    let md = headline_table(
        &rows,
        "p2p",
        &ways,
        &[1024, 1 << 30],
        &[Mode::Eager, Mode::Graph],
    );
    let lines: Vec<&str> = md.lines().collect();
    assert!(
        lines[0].contains("fastest NCCL (nccl, nccl-raw, nccl-threads)"),
        "{md}"
    );
    // 1 KiB: against nccl-threads (9.5 us), not gpucast's own one-thread NCCL path (20.2 us).
    let small = lines
        .iter()
        .find(|l| l.contains("| 1K, eager |"))
        .expect(&md);
    assert!(small.contains("9.50 us (nccl-threads)"), "{small}");
    assert!(small.contains("**6.10 us**"), "{small}");
    assert!(small.contains("1.56x"), "{small}");
    assert!(!small.contains("3.31x"), "{small}");
    // 1 GiB: the medians differ, the spreads overlap: no bold, and said so.
    let large = lines
        .iter()
        .find(|l| l.contains("| 1G, eager |"))
        .expect(&md);
    assert!(!large.contains("**"), "{large}");
    assert!(large.contains("within the spread"), "{large}");
    assert!(large.contains("GB/s (nccl)"), "{large}");
    // A point with no baseline at that size is left out, not compared with another size.
    assert!(!md.contains("1K, graph"), "{md}");
}

#[test]
fn the_fair_ratio_line_counts_the_sizes_outside_the_spread() {
    let rows = vec![
        spread("p2p", Mode::Eager, 1024, [5.0, 5.3, 6.0]),
        spread("best", Mode::Eager, 1024, [13.0, 14.0, 15.0]),
        spread("p2p", Mode::Eager, 2048, [5.0, 5.4, 6.0]),
        spread("best", Mode::Eager, 2048, [5.5, 5.6, 7.0]),
    ];
    let line = ratio_line(&rows, Mode::Eager, "p2p", "best", 0..=4096, "<= 4K").unwrap();
    assert!(line.contains("1 of 2 sizes outside the spread"), "{line}");
}

#[test]
fn every_file_opens_with_its_stamp() {
    let stamp = Stamp {
        commit: "e287451".into(),
        gpu: "1x NVIDIA H100 80GB HBM3".into(),
        driver: "580.159.04 (CUDA 13.0)".into(),
        nccl: "2.28.3".into(),
        command: "bench-broadcast --bench --gpus 1\n--out 'a b'".into(),
    };
    let header = stamp.header();
    let lines: Vec<&str> = header.lines().collect();
    assert_eq!(lines.len(), 5, "{header}");
    for (line, key) in lines
        .iter()
        .zip(["commit", "gpu", "driver", "nccl", "command"])
    {
        assert!(line.starts_with(&format!("# {key}: ")), "{line}");
    }
    // A line break in a value cannot end the comment early.
    assert!(lines[4].contains("--gpus 1 --out"), "{header}");
    assert_eq!(
        Stamp::parse(&header).map(|s| s.commit),
        Some("e287451".into())
    );
    // A stamped CSV still reads back.
    let rows = sample_rows();
    let mut csv = header.clone().into_bytes();
    write_csv(&rows, &mut csv).unwrap();
    assert_eq!(read_csv(&csv[..]).unwrap(), rows);
    assert!(Stamp::parse(std::str::from_utf8(&csv).unwrap()).is_some());
    // A file without one has none.
    assert_eq!(Stamp::parse(CSV_HEADER), None);
}

#[test]
fn the_commit_comes_from_the_staging_then_the_build() {
    assert_eq!(
        commit_of(Some("abc1234-dirty"), Some("def5678")),
        "abc1234-dirty"
    );
    assert_eq!(
        commit_of(Some("  "), Some("def5678")),
        "def5678 (built from)"
    );
    assert_eq!(commit_of(None, Some("def5678")), "def5678 (built from)");
    assert_eq!(commit_of(None, None), "unknown");
}

#[test]
fn the_driver_version_is_read_from_the_kernel_module() {
    let proc = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue Oct 14 2025\n\
                GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n";
    assert_eq!(driver_from_proc(proc).as_deref(), Some("580.159.04"));
    let open =
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build\n";
    assert_eq!(driver_from_proc(open).as_deref(), Some("570.86.15"));
    assert_eq!(driver_from_proc("nothing here"), None);
}

#[test]
fn command_lines_are_quoted_for_a_shell() {
    let args: Vec<String> = ["bench", "--out", "a b", "--paths", "p2p,nccl", "it's"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        shell_line(&args),
        "bench --out 'a b' --paths p2p,nccl 'it'\\''s'"
    );
}

/// The call-cost budget: each line the difference of two interleaved paths, per mode, as the
/// median over the sizes of the range, with its spread; a line whose paths were not both
/// measured in a mode says so.
#[test]
fn the_budget_splits_a_call_into_its_parts() {
    let mut rows = Vec::new();
    for (bytes, extra) in [(1024u64, 0.0), (4096, 0.2), (16384, 0.4)] {
        for (path, t) in [
            ("launch-floor", 2.0),
            ("nccl-raw", 5.0),
            ("nccl-untracked-nowatch", 5.5),
            ("nccl-untracked", 6.4),
            ("nccl-nowatch", 7.2),
            ("nccl", 8.0),
        ] {
            rows.push(row(path, Mode::Eager, bytes, t + extra));
        }
        rows.push(row("nccl", Mode::Idle, bytes, 20.0 + extra));
        rows.push(row("nccl-raw", Mode::Idle, bytes, 12.0));
    }
    // Outside the range: left out.
    rows.push(row("nccl", Mode::Eager, 1 << 20, 100.0));
    rows.push(row("nccl-raw", Mode::Eager, 1 << 20, 10.0));
    let md = budget_table(&rows, &[Mode::Eager, Mode::Idle], 0..=64 << 10);
    let line = |label: &str| {
        md.lines()
            .find(|l| l.starts_with(&format!("| {label}")))
            .unwrap_or_else(|| panic!("no line {label:?} in\n{md}"))
            .to_string()
    };
    assert!(
        md.lines().next().unwrap().contains("| eager | idle |"),
        "{md}"
    );
    assert!(
        line("launch floor").contains("| 2.20 us (2.00 to 2.40, 3 sizes) |"),
        "{md}"
    );
    assert!(
        line("gpucast's own host work").contains("| +0.50 us |"),
        "{md}"
    );
    assert!(line("cudarc's events").contains("| +1.60 us |"), "{md}");
    assert!(line("the watchdog").contains("| +0.80 us |"), "{md}");
    // Idle: only nccl and nccl-raw were measured; 8.00 to 8.40 us over the raw call.
    let total = line("gpucast's NCCL path over a raw ncclBroadcast");
    assert!(total.contains("| +3.00 us |"), "{total}");
    assert!(
        total.contains("| +8.20 us (8.00 to 8.40, 3 sizes) |"),
        "{total}"
    );
    assert!(line("the watchdog").ends_with("| - |"), "{md}");
    assert!(!md.contains("90.00"), "{md}");
}
