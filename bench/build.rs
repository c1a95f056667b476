//! Records the commit the bench is built from (`GPUCAST_BUILD_COMMIT`, read with
//! `option_env!`), with `-dirty` when tracked files differ from it, for the stamp at the top
//! of every table and CSV the bench writes. A run's `GPUCAST_COMMIT` takes precedence (the GPU
//! machine runs binaries staged elsewhere). Without git, nothing is recorded.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    // Rebuilt when HEAD moves (a commit, a checkout) or the index changes.
    for name in ["HEAD", "index"] {
        if let Some(path) = git(&["rev-parse", "--git-path", name]) {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
    if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(path) = git(&["rev-parse", "--git-path", &reference]) {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
    let Some(commit) = git(&["rev-parse", "--short", "HEAD"]) else {
        return;
    };
    let clean = Command::new("git")
        .args(["diff", "--quiet", "HEAD", "--", ".."])
        .status()
        .is_ok_and(|s| s.success());
    let dirty = if clean { "" } else { "-dirty" };
    println!("cargo:rustc-env=GPUCAST_BUILD_COMMIT={commit}{dirty}");
}
