//! The smallest real use of gpucast: broadcast a buffer from GPU 0 to every GPU and check it.
//!
//! `cargo run --release --example broadcast` — on a machine without a GPU it exits with the
//! library's error, which names what is missing and how to fix it.

use gpucast::prelude::*;
use gpucast::Clique;

fn main() -> anyhow::Result<()> {
    // RUST_LOG=gpucast=debug shows the clique's creation and one span per broadcast (its path).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .init();
    let clique = Clique::all()?;
    println!("{}", clique.topology());

    let n = 1 << 20;
    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let input = clique.stream(0).clone_htod(&data)?;
    let mut outputs = (0..clique.len())
        .map(|rank| clique.stream(rank).alloc_zeros::<f32>(n))
        .collect::<Result<Vec<_>, _>>()?;

    let route = clique.route(n * 4, &Default::default())?;
    clique.broadcast(0, &input, &mut outputs)?;
    clique.synchronize()?;

    for (rank, out) in outputs.iter().enumerate() {
        let got = clique.stream(rank).clone_dtoh(out)?;
        anyhow::ensure!(got == data, "rank {rank} received wrong data");
    }
    println!(
        "broadcast {} floats from GPU {} to {} GPUs by {}: every copy checked",
        n,
        clique.ordinals()[0],
        clique.len(),
        route.name()
    );
    Ok(())
}
