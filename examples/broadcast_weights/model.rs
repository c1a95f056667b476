//! The CPU half of the `broadcast_weights` example: a decoder-only transformer's weights as plain
//! host byte buffers, synthesized at random or read from / written to a `.safetensors` file.
//!
//! Nothing here touches a GPU. [`HostTensor`] is what the broadcast side uploads: a name, a
//! [`DType`], a shape and the raw little-endian bytes.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use gpucast::DType;
use indicatif::ProgressBar;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensorError, SafeTensors, View};

/// One tensor held in host memory.
///
/// Invariant: `data.len() == self.len() * dtype.size()` (the bytes of a row-major, little-endian
/// array of `shape`). A scalar has an empty `shape` and one element.
#[derive(Clone, PartialEq, Eq)]
pub struct HostTensor {
    /// Tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Raw element bytes, little-endian, row-major.
    pub data: Vec<u8>,
}

impl HostTensor {
    /// Number of elements: the product of `shape` (1 for a scalar).
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements (some dimension is 0).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the tensor's data in bytes: `len() * dtype.size()`.
    pub fn nbytes(&self) -> usize {
        self.len() * self.dtype.size()
    }
}

/// Prints name, dtype, shape and size, never the (possibly gigabytes of) data.
impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostTensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.data.len())
            .finish()
    }
}

/// Lets `safetensors::serialize_to_file` write a [`HostTensor`] without copying it.
impl View for &HostTensor {
    fn dtype(&self) -> Dtype {
        dtype_to_safetensors(self.dtype)
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }

    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The shape of a Llama-style decoder-only transformer (HF `LlamaForCausalLM` tensor layout).
///
/// `head_dim = hidden / heads`; `heads` must divide `hidden`, and `kv_heads` (grouped-query
/// attention) must divide `heads`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// Vocabulary size (rows of the embedding and of `lm_head`).
    pub vocab: usize,
    /// Model (residual stream) width.
    pub hidden: usize,
    /// MLP inner width.
    pub intermediate: usize,
    /// Number of decoder layers.
    pub layers: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Element type of every tensor.
    pub dtype: DType,
    /// Whether `lm_head` shares the embedding matrix (then no `lm_head.weight` tensor exists).
    pub tied_embeddings: bool,
}

/// Vocabulary of the base shape family (Llama 3). `128256 = 501 * 2^8`, so it halves exactly
/// [`MAX_SHRINK`] times.
const BASE_VOCAB: usize = 128_256;
/// Hidden size of the base shape family (Llama-3.2-1B).
const BASE_HIDDEN: usize = 2048;
/// Attention head width of the base family.
const BASE_HEAD_DIM: usize = 64;
/// How many times [`ModelSpec::scaled_to`] may halve `hidden` and `vocab` (down to hidden 8,
/// vocab 501) for small targets.
const MAX_SHRINK: u32 = 8;

impl ModelSpec {
    /// The example's default model: about 1.50 GB in bf16 (749 M parameters, 74 tensors).
    ///
    /// It has exactly the widths of Llama-3.2-1B (vocab 128256, hidden 2048, intermediate 8192,
    /// 32 heads, 8 KV heads, head_dim 64, tied embeddings) but 8 layers instead of 16: the real
    /// 16-layer model is 1.24 B parameters, i.e. 2.47 GB in bf16.
    pub fn default_1b() -> ModelSpec {
        Self::family(0, 8, DType::BF16)
    }

    /// A model of the default's shape family whose [`total_bytes`](Self::total_bytes) is close
    /// to `target_bytes` in `dtype` (within a few percent from 1 MB up; always within ±30% for
    /// 1 MB to 20 GB and beyond).
    ///
    /// Targets of about 0.8 GB (bf16) and more keep the full Llama-3.2-1B widths and only pick the
    /// layer count. Smaller targets halve `hidden`, `intermediate` and `vocab` together
    /// (head_dim stays 64 while at least one head remains) until at least two layers fit. Below
    /// about 10 KB (bf16) the smallest model (hidden 8, vocab 501, one layer) is returned, which
    /// is larger than the target.
    pub fn scaled_to(target_bytes: u64, dtype: DType) -> ModelSpec {
        let target_params = target_bytes / dtype.size() as u64;
        for shrink in 0..=MAX_SHRINK {
            let fixed = Self::family(shrink, 0, dtype).num_params();
            let per_layer = Self::family(shrink, 1, dtype).num_params() - fixed;
            let min_layers = if shrink == MAX_SHRINK { 1 } else { 2 };
            if fixed + min_layers * per_layer <= target_params || shrink == MAX_SHRINK {
                // Nearest layer count, by integer rounding.
                let layers = (target_params.saturating_sub(fixed) + per_layer / 2) / per_layer;
                let layers = usize::try_from(layers.max(min_layers)).unwrap_or(usize::MAX);
                return Self::family(shrink, layers, dtype);
            }
        }
        unreachable!("the loop returns at shrink == MAX_SHRINK")
    }

    /// The base family with `hidden` and `vocab` halved `shrink` times.
    fn family(shrink: u32, layers: usize, dtype: DType) -> ModelSpec {
        let hidden = BASE_HIDDEN >> shrink;
        let heads = (hidden / BASE_HEAD_DIM).max(1);
        ModelSpec {
            vocab: BASE_VOCAB >> shrink,
            hidden,
            intermediate: 4 * hidden,
            layers,
            heads,
            kv_heads: (heads / 4).max(1),
            dtype,
            tied_embeddings: true,
        }
    }

    /// Width of one attention head: `hidden / heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }

    /// Every tensor's name and shape, in the order of the HF Llama module tree: the embedding,
    /// then per layer `input_layernorm`, `q/k/v/o_proj`, `post_attention_layernorm`,
    /// `gate/up/down_proj`, then `model.norm` and (unless tied) `lm_head`.
    ///
    /// That is `1 + 9 * layers + 1` tensors, plus one when the embeddings are untied.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, hd) = (self.hidden, self.head_dim());
        let (q, kv, inter) = (self.heads * hd, self.kv_heads * hd, self.intermediate);
        let mut out = Vec::with_capacity(3 + 9 * self.layers);
        out.push(("model.embed_tokens.weight".to_string(), vec![self.vocab, h]));
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.input_layernorm.weight"), vec![h]));
            out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
            out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            out.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, h]));
            out.push((format!("{p}.mlp.up_proj.weight"), vec![inter, h]));
            out.push((format!("{p}.mlp.down_proj.weight"), vec![h, inter]));
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tied_embeddings {
            out.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        }
        out
    }

    /// Number of parameters (elements over all tensors).
    pub fn num_params(&self) -> u64 {
        let (h, hd) = (self.hidden as u64, self.head_dim() as u64);
        let (q, kv) = (self.heads as u64 * hd, self.kv_heads as u64 * hd);
        let inter = self.intermediate as u64;
        let embed = self.vocab as u64 * h;
        let per_layer = 2 * h + 2 * q * h + 2 * kv * h + 3 * inter * h;
        let head = if self.tied_embeddings { 0 } else { embed };
        embed + self.layers as u64 * per_layer + h + head
    }

    /// Size of all tensors in bytes: `num_params() * dtype.size()`.
    pub fn total_bytes(&self) -> u64 {
        self.num_params() * self.dtype.size() as u64
    }
}

/// One line, e.g. `8 layers, hidden 2048, intermediate 8192, 32/8 heads, vocab 128256, tied,
/// bf16: 749.2 M params, 1.50 GB`.
impl fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers, hidden {}, intermediate {}, {}/{} heads, vocab {}, {}, {}: {:.1} M params, {}",
            self.layers,
            self.hidden,
            self.intermediate,
            self.heads,
            self.kv_heads,
            self.vocab,
            if self.tied_embeddings { "tied" } else { "untied" },
            self.dtype,
            self.num_params() as f64 / 1e6,
            human_bytes(self.total_bytes()),
        )
    }
}

/// Bytes generated per work item in [`synthesize`] (a multiple of 8).
const SYNTH_BLOCK: usize = 4 << 20;

/// splitmix64's increment (the golden ratio in 64-bit fixed point).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function: a bijective 64-bit mixer.
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `(and, or)` masks applied to each random 64-bit word so float lanes hold finite values of
/// magnitude in [2^-7, 2^-3) with a random sign (exponent forced to 4 consecutive values,
/// random mantissa). Integer dtypes keep all bits random.
fn float_masks(dtype: DType) -> (u64, u64) {
    match dtype {
        // sign | low 2 exponent bits | mantissa, and exponent 120 (bias 127) per 16-bit lane.
        DType::BF16 => (0x81FF_81FF_81FF_81FF, 0x3C00_3C00_3C00_3C00),
        // Same for f16: exponent 8 (bias 15).
        DType::F16 => (0x8FFF_8FFF_8FFF_8FFF, 0x2000_2000_2000_2000),
        // f32 is bf16 with 16 more mantissa bits.
        DType::F32 => (0x81FF_FFFF_81FF_FFFF, 0x3C00_0000_3C00_0000),
        // f64: exponent 1016 (bias 1023).
        DType::F64 => (0x803F_FFFF_FFFF_FFFF, 0x3F80_0000_0000_0000),
        // Integers (and any dtype added later): all bits random.
        _ => (!0, 0),
    }
}

/// Fills `block` with the words `first_word..` of the counter-based stream `key`. Because each
/// word depends only on `(key, index)`, the result does not depend on how a tensor is split
/// into blocks or threads.
fn fill_block(block: &mut [u8], key: u64, first_word: u64, masks: (u64, u64)) {
    let (and, or) = masks;
    let word = |i: u64| (mix64(key.wrapping_add(i.wrapping_mul(GAMMA))) & and) | or;
    let mut chunks = block.chunks_exact_mut(8);
    let mut i = first_word;
    for chunk in &mut chunks {
        chunk.copy_from_slice(&word(i).to_le_bytes());
        i += 1;
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        // dtype sizes divide 8, so the cut keeps whole elements.
        rest.copy_from_slice(&word(i).to_le_bytes()[..rest.len()]);
    }
}

/// A model of shape `spec` with random contents, in [`ModelSpec::tensor_shapes`] order.
///
/// The same `(spec, seed)` always gives the same bytes; different seeds give different bytes.
/// Float tensors hold finite values of magnitude in [2^-7, 2^-3) (about 0.008 to 0.125) with
/// random signs; integer tensors hold uniformly random bits. The work is spread over all CPU
/// cores (a counter-based splitmix64 stream, 8 bytes per step). `progress`, if given, is
/// advanced by bytes generated (and its length set to the total if it has none).
pub fn synthesize(spec: &ModelSpec, seed: u64, progress: Option<&ProgressBar>) -> Vec<HostTensor> {
    let dtype = spec.dtype;
    let masks = float_masks(dtype);
    if let Some(pb) = progress {
        if pb.length().is_none() {
            pb.set_length(spec.total_bytes());
        }
    }
    let mut tensors: Vec<HostTensor> = spec
        .tensor_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let nbytes = shape.iter().product::<usize>() * dtype.size();
            // `vec![0; n]` is calloc: pages are only touched when filled below.
            HostTensor {
                name,
                dtype,
                shape,
                data: vec![0u8; nbytes],
            }
        })
        .collect();

    let seed_key = mix64(seed ^ 0x6770_7563_6173_7421); // "gpucast!"
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Round-robin the blocks over the threads.
    let mut work: Vec<Vec<(u64, u64, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    let mut next = 0;
    for (t, tensor) in tensors.iter_mut().enumerate() {
        let key = mix64(seed_key ^ mix64((t as u64).wrapping_add(1).wrapping_mul(GAMMA)));
        for (b, block) in tensor.data.chunks_mut(SYNTH_BLOCK).enumerate() {
            let first_word = (b * (SYNTH_BLOCK / 8)) as u64;
            work[next % threads].push((key, first_word, block));
            next += 1;
        }
    }
    std::thread::scope(|s| {
        for items in work.into_iter().filter(|w| !w.is_empty()) {
            s.spawn(move || {
                for (key, first_word, block) in items {
                    fill_block(block, key, first_word, masks);
                    if let Some(pb) = progress {
                        pb.inc(block.len() as u64);
                    }
                }
            });
        }
    });
    tensors
}

/// The safetensors dtype of a gpucast [`DType`]. Every `DType` this example knows has one.
///
/// # Panics
///
/// For a `DType` variant added to gpucast after this example was written (`DType` is
/// `#[non_exhaustive]`); [`save_safetensors`] checks first and returns an error instead.
pub fn dtype_to_safetensors(d: DType) -> Dtype {
    try_dtype_to_safetensors(d)
        .unwrap_or_else(|| panic!("gpucast dtype {d} has no safetensors equivalent"))
}

/// [`dtype_to_safetensors`] without the panic.
fn try_dtype_to_safetensors(d: DType) -> Option<Dtype> {
    Some(match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I8 => Dtype::I8,
        DType::U8 => Dtype::U8,
        DType::I32 => Dtype::I32,
        DType::U32 => Dtype::U32,
        DType::I64 => Dtype::I64,
        DType::U64 => Dtype::U64,
        _ => return None,
    })
}

/// The gpucast [`DType`] of a safetensors dtype, or `None` for those gpucast does not have
/// (`BOOL`, `I16`, `U16`, `C64`, the `F8_*`/`F6_*`/`F4` formats, and any added later).
pub fn dtype_from_safetensors(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I8 => DType::I8,
        Dtype::U8 => DType::U8,
        Dtype::I32 => DType::I32,
        Dtype::U32 => DType::U32,
        Dtype::I64 => DType::I64,
        Dtype::U64 => DType::U64,
        _ => return None,
    })
}

/// Writes `tensors` to `path` as a safetensors file, with the header metadata
/// `{"format": "pt", "generator": "gpucast broadcast_weights"}`.
///
/// The file is written to a temporary sibling and renamed into place. Its layout is
/// safetensors' canonical one (grouped by dtype, widest first, then sorted by name), so
/// [`load_safetensors`] returns the tensors in that order, not necessarily in the order given.
/// Fails, writing nothing, if two tensors share a name, a tensor's `data` length does not
/// match its shape and dtype, or a dtype has no safetensors equivalent.
pub fn save_safetensors(tensors: &[HostTensor], path: &Path) -> Result<()> {
    let mut seen = HashSet::with_capacity(tensors.len());
    for t in tensors {
        if !seen.insert(t.name.as_str()) {
            bail!(
                "cannot write {}: tensor name `{}` appears twice",
                path.display(),
                t.name
            );
        }
        let expected = t
            .shape
            .iter()
            .try_fold(t.dtype.size(), |acc, &d| acc.checked_mul(d));
        if expected != Some(t.data.len()) {
            bail!(
                "cannot write {}: tensor `{}` ({} {:?}) has {} bytes of data, expected {}",
                path.display(),
                t.name,
                t.dtype,
                t.shape,
                t.data.len(),
                expected.map_or_else(|| "an overflowing size".to_string(), |n| n.to_string()),
            );
        }
    }
    let metadata: HashMap<String, String> = [
        ("format".to_string(), "pt".to_string()),
        (
            "generator".to_string(),
            "gpucast broadcast_weights".to_string(),
        ),
    ]
    .into();
    // safetensors puts its temporary file in `path.parent()`, which is "" for a bare file name.
    let path_buf: PathBuf = match path.parent() {
        Some(p) if p.as_os_str().is_empty() => Path::new(".").join(path),
        _ => path.to_path_buf(),
    };
    safetensors::serialize_to_file(
        tensors.iter().map(|t| (t.name.as_str(), t)),
        Some(metadata),
        &path_buf,
    )
    .map_err(|e| match e {
        SafeTensorError::IoError(io) => anyhow!(io),
        other => anyhow!("{other}"),
    })
    .with_context(|| format!("cannot write {}", path.display()))
}

/// Largest header the safetensors crate accepts (its `MAX_HEADER_SIZE`).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Bytes read per step (and progress update) while loading a tensor.
const LOAD_CHUNK: usize = 16 << 20;

/// Reads every tensor of the safetensors file at `path` into host memory.
///
/// Tensors come back in file order, i.e. by ascending data offset (safetensors' own
/// `tensors()`/`iter()` use hash order; the header's offsets restore the file's). `progress`,
/// if given, is advanced by tensor bytes read (and its length set to the file's tensor-data
/// size if it has none).
///
/// The header is parsed and validated by the `safetensors` crate before any tensor data is
/// read; then each tensor is read straight from the file into its own buffer, so the peak
/// memory is about the file size, not twice it. Errors name the file and say what is wrong:
/// missing/unreadable file, too short for the 8-byte header length, header length beyond the
/// end of the file, header not UTF-8/JSON, offsets that do not match the file (truncated or
/// corrupt), a dtype gpucast does not support (naming the tensor), or running out of memory.
pub fn load_safetensors(path: &Path, progress: Option<&ProgressBar>) -> Result<Vec<HostTensor>> {
    let shown = path.display();
    let mut file = File::open(path).with_context(|| format!("cannot open {shown}"))?;
    let file_len = file
        .metadata()
        .with_context(|| format!("cannot stat {shown}"))?
        .len();
    let (header_len, metadata) = read_header(&mut file, path, file_len)?;

    // Check every dtype before reading gigabytes.
    let names = metadata.offset_keys();
    let mut plan = Vec::with_capacity(names.len());
    for name in names {
        let info = metadata
            .info(&name)
            .ok_or_else(|| anyhow!("{shown}: tensor `{name}` vanished from the parsed header"))?;
        let dtype = dtype_from_safetensors(info.dtype).ok_or_else(|| {
            anyhow!(
                "{shown}: tensor `{name}` has dtype {}, which gpucast does not support \
                 (supported: F32, F64, F16, BF16, I8, U8, I32, U32, I64, U64)",
                info.dtype
            )
        })?;
        let (start, end) = info.data_offsets;
        plan.push((name, dtype, info.shape.clone(), start, end - start));
    }
    let data_bytes = metadata.data_len() as u64;
    if let Some(pb) = progress {
        if pb.length().is_none() {
            pb.set_length(data_bytes);
        }
    }

    let data_start = 8 + header_len;
    file.seek(SeekFrom::Start(data_start))
        .with_context(|| format!("cannot seek in {shown}"))?;
    let mut tensors = Vec::with_capacity(plan.len());
    for (name, dtype, shape, start, nbytes) in plan {
        let mut data = Vec::new();
        data.try_reserve_exact(nbytes).map_err(|_| {
            anyhow!(
                "{shown}: not enough memory for tensor `{name}` ({})",
                human_bytes(nbytes as u64)
            )
        })?;
        let mut left = nbytes;
        while left > 0 {
            let step = left.min(LOAD_CHUNK);
            let got = (&mut file)
                .take(step as u64)
                .read_to_end(&mut data)
                .with_context(|| format!("error reading tensor `{name}` from {shown}"))?;
            if got < step {
                bail!(
                    "{shown} is truncated: it ended inside tensor `{name}` (offset {})",
                    data_start + (start + data.len()) as u64
                );
            }
            left -= step;
            if let Some(pb) = progress {
                pb.inc(step as u64);
            }
        }
        tensors.push(HostTensor {
            name,
            dtype,
            shape,
            data,
        });
    }
    Ok(tensors)
}

/// Reads the 8-byte length and the JSON header of a safetensors file and validates them with
/// the safetensors crate against the file's length. Returns the header length and the parsed
/// metadata (tensor dtypes, shapes and data offsets).
fn read_header(file: &mut File, path: &Path, file_len: u64) -> Result<(u64, Metadata)> {
    let shown = path.display();
    let not_st = |why: String| anyhow!("{shown} is not a safetensors file (or is corrupt): {why}");
    if file_len < 8 {
        return Err(not_st(format!(
            "it is {file_len} bytes long, too short for the 8-byte header length"
        )));
    }
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix)
        .with_context(|| format!("cannot read {shown}"))?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > file_len - 8 {
        return Err(not_st(format!(
            "its header length field says {header_len} bytes but only {} bytes follow it \
             (file truncated, or not safetensors)",
            file_len - 8
        )));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(not_st(format!(
            "its header length field says {header_len} bytes, more than the 100 MB that \
             safetensors allows"
        )));
    }
    let total = usize::try_from(file_len)
        .map_err(|_| anyhow!("{shown} is too large ({file_len} bytes) for this platform"))?;
    // `SafeTensors::read_metadata` wants a buffer as long as the whole file (it checks that the
    // offsets cover it exactly) but only reads the header part. A zeroed Vec is allocated with
    // calloc, which leaves untouched pages unmapped, so this costs about the header's size, not
    // the file's. The fallible reservation first turns "file larger than memory" into an error
    // instead of an abort.
    let mut check = Vec::<u8>::new();
    check
        .try_reserve_exact(total)
        .map_err(|_| anyhow!("{shown} ({}) does not fit in memory", human_bytes(file_len)))?;
    drop(check);
    let mut probe = vec![0u8; total];
    // header_len <= file_len - 8, and file_len fits in usize.
    let header_end = 8 + usize::try_from(header_len).unwrap_or(total);
    probe[..8].copy_from_slice(&prefix);
    file.read_exact(&mut probe[8..header_end])
        .with_context(|| format!("cannot read the header of {shown}"))?;
    let metadata = SafeTensors::read_metadata(&probe)
        .map(|(_, metadata)| metadata)
        .map_err(|e| describe_safetensors_error(&e, path, file_len - 8 - header_len))?;
    Ok((header_len, metadata))
}

/// Says in plain words what a header-parsing error from the safetensors crate means.
fn describe_safetensors_error(e: &SafeTensorError, path: &Path, data_bytes: u64) -> anyhow::Error {
    let shown = path.display();
    match e {
        SafeTensorError::InvalidHeader(utf8) => {
            anyhow!("{shown} is not a safetensors file (or is corrupt): its header is not UTF-8 text ({utf8})")
        }
        SafeTensorError::InvalidHeaderDeserialization(json) | SafeTensorError::JsonError(json) => {
            anyhow!("{shown} is not a safetensors file (or is corrupt): its header is not valid safetensors JSON ({json})")
        }
        SafeTensorError::HeaderTooLarge
        | SafeTensorError::HeaderTooSmall
        | SafeTensorError::InvalidHeaderLength => {
            anyhow!("{shown} is not a safetensors file (or is corrupt): bad header length ({e})")
        }
        SafeTensorError::MetadataIncompleteBuffer => anyhow!(
            "{shown} is truncated or corrupt: the tensor offsets in its header do not add up to \
             the {data_bytes} bytes of data that follow the header"
        ),
        SafeTensorError::InvalidOffset(name) => anyhow!(
            "{shown} is truncated or corrupt: tensor `{name}` has data offsets that overlap, \
             leave a gap, or run backwards"
        ),
        SafeTensorError::TensorInvalidInfo => anyhow!(
            "{shown} is truncated or corrupt: a tensor's data offsets do not match its shape \
             and dtype"
        ),
        SafeTensorError::ValidationOverflow => {
            anyhow!("{shown} is truncated or corrupt: a tensor's shape is too large to be real")
        }
        other => anyhow!("{shown} is truncated or corrupt: {other}"),
    }
}

/// Number of tensors and their total size in bytes.
pub fn summarize(tensors: &[HostTensor]) -> (usize, u64) {
    (
        tensors.len(),
        tensors.iter().map(|t| t.data.len() as u64).sum(),
    )
}

/// A byte count in decimal units with three significant figures: `"512 B"`, `"12.3 kB"`,
/// `"1.50 GB"`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["kB", "MB", "GB", "TB", "PB", "EB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1000.0;
    let mut unit = 0;
    while value >= 999.5 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    let digits = if value >= 99.95 {
        0
    } else if value >= 9.995 {
        1
    } else {
        2
    };
    format!("{value:.digits$} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucast::half::{bf16, f16};
    use rand::{RngCore, SeedableRng};
    use std::sync::atomic::{AtomicUsize, Ordering};

    const MB: u64 = 1_000_000;
    const GB: u64 = 1_000_000_000;

    /// A unique path in the temp dir, removed when dropped.
    struct TempPath(PathBuf);

    impl TempPath {
        fn new(tag: &str) -> TempPath {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let name = format!("gpucast-bw-{}-{tag}-{n}.safetensors", std::process::id());
            TempPath(std::env::temp_dir().join(name))
        }
    }

    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn tensor(name: &str, dtype: DType, shape: &[usize], seed: u8) -> HostTensor {
        let n: usize = shape.iter().product::<usize>() * dtype.size();
        let data = (0..n)
            .map(|i| {
                (i % 256).to_le_bytes()[0]
                    .wrapping_mul(31)
                    .wrapping_add(seed)
            })
            .collect();
        HostTensor {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            data,
        }
    }

    /// Error text with its whole context chain.
    fn err_text(e: &anyhow::Error) -> String {
        format!("{e:#}")
    }

    fn small_spec() -> ModelSpec {
        ModelSpec::scaled_to(2 * MB, DType::BF16)
    }

    #[test]
    fn default_1b_size_and_shape() {
        let spec = ModelSpec::default_1b();
        let bytes = spec.total_bytes();
        assert!(
            (GB..=2 * GB).contains(&bytes),
            "default model is {bytes} bytes"
        );
        assert_eq!(bytes, 1_498_484_736);
        assert_eq!(spec.dtype, DType::BF16);
        assert_eq!(spec.head_dim(), 64);
        let shapes = spec.tensor_shapes();
        assert_eq!(shapes.len(), 74);
        let summed: u64 = shapes
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum::<u64>()
            * 2;
        assert_eq!(summed, bytes);
        assert!(spec.to_string().contains("1.50 GB"), "{spec}");
    }

    #[test]
    fn scaled_to_lands_near_target() {
        for target in [MB, 10 * MB, 100 * MB, GB, 2 * GB, 20 * GB] {
            for dtype in DType::ALL {
                let spec = ModelSpec::scaled_to(target, dtype);
                let got = spec.total_bytes();
                let ratio = got as f64 / target as f64;
                assert!(
                    (0.7..=1.3).contains(&ratio),
                    "{target} {dtype}: {spec} ({ratio:.3})"
                );
                assert!(spec.layers >= 1);
                assert_eq!(spec.hidden % spec.heads, 0, "{spec}");
                assert_eq!(spec.heads % spec.kv_heads, 0, "{spec}");
                assert_eq!(spec.dtype, dtype);
                // Shapes agree with the closed-form size.
                let summed: u64 = spec
                    .tensor_shapes()
                    .iter()
                    .map(|(_, s)| s.iter().product::<usize>() as u64)
                    .sum();
                assert_eq!(summed * dtype.size() as u64, got);
            }
        }
        // Targets that fit two full-width layers keep the full widths; only the depth changes.
        for target in [GB, 2 * GB, 20 * GB] {
            let spec = ModelSpec::scaled_to(target, DType::BF16);
            let widths = (spec.hidden, spec.vocab, spec.intermediate, spec.heads);
            assert_eq!(widths, (2048, 128_256, 8192, 32), "{spec}");
        }
        // Smaller targets shrink the widths only as far as needed for two layers.
        let spec = ModelSpec::scaled_to(100 * MB, DType::BF16);
        assert_eq!((spec.hidden, spec.head_dim()), (512, 64), "{spec}");
        // Dense sweep: every target from 1 MB to 20 GB in ~5% steps is met within 30%.
        let mut target = MB;
        while target <= 20 * GB {
            let spec = ModelSpec::scaled_to(target, DType::BF16);
            let ratio = spec.total_bytes() as f64 / target as f64;
            assert!(
                (0.7..=1.3).contains(&ratio),
                "{target}: {spec} ({ratio:.3})"
            );
            target += target / 20;
        }
        // Tiny or zero targets give the smallest model rather than panicking.
        let tiny = ModelSpec::scaled_to(0, DType::F64);
        assert_eq!((tiny.layers, tiny.hidden), (1, 8));
    }

    #[test]
    fn tensor_names_and_shapes() {
        let spec = ModelSpec {
            vocab: 1000,
            hidden: 256,
            intermediate: 688,
            layers: 3,
            heads: 8,
            kv_heads: 2,
            dtype: DType::F16,
            tied_embeddings: true,
        };
        let shapes = spec.tensor_shapes();
        assert_eq!(shapes.len(), 1 + 3 * 9 + 1);
        let get = |name: &str| {
            shapes
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s.clone())
                .unwrap_or_else(|| {
                    panic!("missing {name}");
                })
        };
        assert_eq!(shapes[0].0, "model.embed_tokens.weight");
        assert_eq!(get("model.embed_tokens.weight"), [1000, 256]);
        assert_eq!(get("model.layers.2.input_layernorm.weight"), [256]);
        assert_eq!(get("model.layers.0.self_attn.q_proj.weight"), [256, 256]);
        assert_eq!(get("model.layers.1.self_attn.k_proj.weight"), [64, 256]);
        assert_eq!(get("model.layers.1.self_attn.v_proj.weight"), [64, 256]);
        assert_eq!(get("model.layers.2.self_attn.o_proj.weight"), [256, 256]);
        assert_eq!(get("model.layers.0.post_attention_layernorm.weight"), [256]);
        assert_eq!(get("model.layers.0.mlp.gate_proj.weight"), [688, 256]);
        assert_eq!(get("model.layers.0.mlp.up_proj.weight"), [688, 256]);
        assert_eq!(get("model.layers.2.mlp.down_proj.weight"), [256, 688]);
        assert_eq!(
            shapes.last().map(|(n, _)| n.as_str()),
            Some("model.norm.weight")
        );
        assert!(!shapes.iter().any(|(n, _)| n == "lm_head.weight"));
        assert!(!shapes.iter().any(|(n, _)| n.starts_with("model.layers.3.")));
        let names: HashSet<_> = shapes.iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), shapes.len(), "duplicate names");
        let elems: u64 = shapes
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum();
        assert_eq!(elems, spec.num_params());

        let untied = ModelSpec {
            tied_embeddings: false,
            ..spec
        };
        let shapes = untied.tensor_shapes();
        assert_eq!(shapes.len(), 1 + 3 * 9 + 1 + 1);
        assert_eq!(
            shapes.last().map(|(n, s)| (n.as_str(), s.clone())),
            Some(("lm_head.weight", vec![1000, 256]))
        );
        assert_eq!(untied.total_bytes(), spec.total_bytes() + 1000 * 256 * 2);
    }

    #[test]
    fn synthesize_is_deterministic_and_seeded() {
        let spec = small_spec();
        let a = synthesize(&spec, 7, None);
        let b = synthesize(&spec, 7, None);
        let c = synthesize(&spec, 8, None);
        assert_eq!(a, b);
        let shapes = spec.tensor_shapes();
        assert_eq!(a.len(), shapes.len());
        for ((t, (name, shape)), other) in a.iter().zip(&shapes).zip(&c) {
            assert_eq!(&t.name, name);
            assert_eq!(&t.shape, shape);
            assert_eq!(t.dtype, DType::BF16);
            assert_eq!(t.data.len(), t.nbytes());
            assert_eq!(t.data.len(), t.len() * 2);
            assert_ne!(t.data, other.data, "{name} is the same for seeds 7 and 8");
        }
        // Tensors of one model differ from each other too (per-tensor streams).
        assert_ne!(a[1].data, a[10].data);
        assert_eq!(summarize(&a), (shapes.len(), spec.total_bytes()));
    }

    #[test]
    fn synthesize_floats_are_plausible_and_progress_counts_bytes() {
        let lo = 2f64.powi(-7);
        let hi = 2f64.powi(-3);
        let check = |x: f64| assert!(x.is_finite() && (lo..hi).contains(&x.abs()), "{x}");
        for dtype in DType::ALL {
            // An odd-sized model: byte counts that are not multiples of 8 exercise the tails.
            let spec = ModelSpec {
                vocab: 37,
                hidden: 15,
                intermediate: 21,
                layers: 2,
                heads: 3,
                kv_heads: 1,
                dtype,
                tied_embeddings: false,
            };
            let pb = ProgressBar::hidden();
            let tensors = synthesize(&spec, 1, Some(&pb));
            assert_eq!(pb.position(), spec.total_bytes());
            assert_eq!(pb.length(), Some(spec.total_bytes()));
            let bytes: Vec<u8> = tensors
                .iter()
                .flat_map(|t| t.data.iter().copied())
                .collect();
            let mut negative = 0;
            let mut count = 0;
            match dtype {
                DType::BF16 | DType::F16 => {
                    for c in bytes.chunks_exact(2) {
                        let bits = u16::from_le_bytes([c[0], c[1]]);
                        let x = if dtype == DType::BF16 {
                            bf16::from_bits(bits).to_f64()
                        } else {
                            f16::from_bits(bits).to_f64()
                        };
                        check(x);
                        negative += usize::from(x < 0.0);
                        count += 1;
                    }
                }
                DType::F32 => {
                    for c in bytes.chunks_exact(4) {
                        let x = f64::from(f32::from_le_bytes(c.try_into().unwrap()));
                        check(x);
                        negative += usize::from(x < 0.0);
                        count += 1;
                    }
                }
                DType::F64 => {
                    for c in bytes.chunks_exact(8) {
                        let x = f64::from_le_bytes(c.try_into().unwrap());
                        check(x);
                        negative += usize::from(x < 0.0);
                        count += 1;
                    }
                }
                _ => {
                    // Integers: random bits, so every byte value shows up in a few KB.
                    let distinct: HashSet<u8> = bytes.iter().copied().collect();
                    assert!(
                        distinct.len() > 200,
                        "{dtype}: {} distinct bytes",
                        distinct.len()
                    );
                    continue;
                }
            }
            // Random signs: roughly half negative.
            assert!(
                negative * 3 > count && negative * 3 < 2 * count,
                "{dtype}: {negative}/{count}"
            );
        }
    }

    #[test]
    fn safetensors_round_trip_model() {
        let spec = ModelSpec {
            tied_embeddings: false,
            ..small_spec()
        };
        let tensors = synthesize(&spec, 42, None);
        let file = TempPath::new("model");
        save_safetensors(&tensors, &file.0).unwrap();
        let pb = ProgressBar::hidden();
        let loaded = load_safetensors(&file.0, Some(&pb)).unwrap();
        assert_eq!(pb.position(), spec.total_bytes());
        assert_eq!(loaded.len(), tensors.len());
        // One dtype: the file is sorted by name.
        let mut expected = tensors.clone();
        expected.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(loaded, expected);
        assert_eq!(summarize(&loaded), summarize(&tensors));
    }

    #[test]
    fn safetensors_round_trip_mixed_dtypes() {
        let tensors = vec![
            tensor("odd.f32", DType::F32, &[3], 1),
            tensor("big.bf16", DType::BF16, &[4095], 2),
            tensor("mat.i8", DType::I8, &[5, 7], 3),
            tensor("u64", DType::U64, &[1], 4),
            tensor("scalar.f64", DType::F64, &[], 5),
            tensor("empty.u8", DType::U8, &[0, 4], 6),
            tensor("f16", DType::F16, &[2, 3, 5], 7),
            tensor("i32", DType::I32, &[4095], 8),
            tensor("u32", DType::U32, &[3, 1], 9),
            tensor("i64", DType::I64, &[2, 2], 10),
        ];
        let file = TempPath::new("mixed");
        save_safetensors(&tensors, &file.0).unwrap();
        let loaded = load_safetensors(&file.0, None).unwrap();
        assert_eq!(loaded.len(), tensors.len());
        for t in &tensors {
            let l = loaded
                .iter()
                .find(|l| l.name == t.name)
                .expect("tensor lost");
            assert_eq!(l.dtype, t.dtype, "{}", t.name);
            assert_eq!(l.shape, t.shape, "{}", t.name);
            assert_eq!(l.data, t.data, "{}", t.name);
        }
        let scalar = loaded.iter().find(|t| t.name == "scalar.f64").unwrap();
        assert_eq!((scalar.len(), scalar.nbytes()), (1, 8));
        assert!(loaded
            .iter()
            .find(|t| t.name == "empty.u8")
            .unwrap()
            .is_empty());
        // The header metadata is there.
        let bytes = std::fs::read(&file.0).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta = meta.metadata().clone().unwrap();
        assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
        assert_eq!(
            meta.get("generator").map(String::as_str),
            Some("gpucast broadcast_weights")
        );
    }

    #[test]
    fn dtype_conversions() {
        for d in DType::ALL {
            assert_eq!(dtype_from_safetensors(dtype_to_safetensors(d)), Some(d));
            assert_eq!(dtype_to_safetensors(d).bitsize(), 8 * d.size());
        }
        for d in [
            Dtype::BOOL,
            Dtype::F8_E4M3,
            Dtype::F8_E5M2,
            Dtype::I16,
            Dtype::U16,
            Dtype::C64,
        ] {
            assert_eq!(dtype_from_safetensors(d), None);
        }
    }

    /// A safetensors file with the given JSON header and `data_len` bytes of data.
    fn write_raw(file: &TempPath, header: &str, data_len: usize) {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&vec![0xAB; data_len]);
        std::fs::write(&file.0, bytes).unwrap();
    }

    #[test]
    fn load_keeps_file_order() {
        // JSON order, name order and offset order all differ.
        let file = TempPath::new("order");
        write_raw(
            &file,
            r#"{"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},
                "c":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                "a":{"dtype":"I32","shape":[1],"data_offsets":[6,10]}}"#,
            10,
        );
        let loaded = load_safetensors(&file.0, None).unwrap();
        let names: Vec<_> = loaded.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["c", "b", "a"]);
        assert_eq!(loaded[2].dtype, DType::I32);
    }

    #[test]
    fn load_rejects_truncated_file() {
        let tensors = synthesize(&ModelSpec::scaled_to(MB, DType::F32), 3, None);
        let file = TempPath::new("trunc");
        save_safetensors(&tensors, &file.0).unwrap();
        let len = std::fs::metadata(&file.0).unwrap().len();
        for cut in [1, 3, 100] {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&file.0)
                .unwrap();
            f.set_len(len - cut).unwrap();
            drop(f);
            let e = err_text(&load_safetensors(&file.0, None).unwrap_err());
            assert!(e.contains(&file.0.display().to_string()), "{e}");
            assert!(e.contains("truncated or corrupt"), "{e}");
        }
        // Cut inside the header.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&file.0)
            .unwrap();
        f.set_len(20).unwrap();
        drop(f);
        let e = err_text(&load_safetensors(&file.0, None).unwrap_err());
        assert!(
            e.contains(&file.0.display().to_string()) && e.contains("truncated"),
            "{e}"
        );
    }

    #[test]
    fn load_rejects_garbage_empty_and_missing() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(99);
        for (i, len) in [1usize, 7, 8, 9, 100, 4096, 100_000]
            .into_iter()
            .enumerate()
        {
            let mut bytes = vec![0u8; len];
            rng.fill_bytes(&mut bytes);
            let file = TempPath::new(&format!("garbage{i}"));
            std::fs::write(&file.0, &bytes).unwrap();
            let e = err_text(&load_safetensors(&file.0, None).unwrap_err());
            assert!(e.contains(&file.0.display().to_string()), "{e}");
            assert!(
                e.contains("not a safetensors file") || e.contains("corrupt"),
                "{e}"
            );
        }
        let empty = TempPath::new("empty");
        std::fs::write(&empty.0, b"").unwrap();
        let e = err_text(&load_safetensors(&empty.0, None).unwrap_err());
        assert!(
            e.contains("0 bytes long") && e.contains(&empty.0.display().to_string()),
            "{e}"
        );

        let missing = TempPath::new("missing");
        let e = err_text(&load_safetensors(&missing.0, None).unwrap_err());
        assert!(
            e.contains("cannot open") && e.contains(&missing.0.display().to_string()),
            "{e}"
        );

        // A directory is not a file either.
        assert!(load_safetensors(&std::env::temp_dir(), None).is_err());
    }

    #[test]
    fn load_rejects_bad_headers() {
        let cases: [(&str, &str, usize, &str); 6] = [
            ("json", "{not json at all}", 0, "not valid safetensors JSON"),
            ("utf8", "\u{0}\u{0}", 0, "not valid safetensors JSON"),
            (
                "gap",
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
                3,
                "tensor `a` has data offsets",
            ),
            (
                "size",
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                4,
                "do not match its shape",
            ),
            (
                "short",
                r#"{"a":{"dtype":"U8","shape":[64],"data_offsets":[0,64]}}"#,
                10,
                "truncated or corrupt",
            ),
            (
                "bool",
                r#"{"flags":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}}"#,
                4,
                "tensor `flags` has dtype BOOL",
            ),
        ];
        for (tag, header, data_len, expect) in cases {
            let file = TempPath::new(tag);
            write_raw(&file, header, data_len);
            let e = err_text(&load_safetensors(&file.0, None).unwrap_err());
            assert!(
                e.contains(expect) && e.contains(&file.0.display().to_string()),
                "{tag}: {e}"
            );
        }
        // Invalid UTF-8 in the header.
        let file = TempPath::new("badutf8");
        let mut bytes = 4u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0xFF, 0xFE, 0xFD, 0xFC]);
        std::fs::write(&file.0, bytes).unwrap();
        let e = err_text(&load_safetensors(&file.0, None).unwrap_err());
        assert!(e.contains("not UTF-8"), "{e}");
        // Header length beyond the end of the file.
        let file = TempPath::new("hdrlen");
        let mut bytes = 1000u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        std::fs::write(&file.0, bytes).unwrap();
        let e = err_text(&load_safetensors(&file.0, None).unwrap_err());
        assert!(e.contains("says 1000 bytes but only 2 bytes follow"), "{e}");
        // An empty but valid file loads as no tensors.
        let file = TempPath::new("none");
        write_raw(&file, "{}", 0);
        assert!(load_safetensors(&file.0, None).unwrap().is_empty());
    }

    #[test]
    fn save_rejects_inconsistent_tensors() {
        let file = TempPath::new("bad-save");
        let mut short = tensor("x", DType::F32, &[4], 0);
        short.data.pop();
        let e = err_text(&save_safetensors(&[short], &file.0).unwrap_err());
        assert!(e.contains("tensor `x`") && e.contains("15 bytes"), "{e}");
        let dup = [
            tensor("x", DType::U8, &[1], 0),
            tensor("x", DType::U8, &[2], 0),
        ];
        let e = err_text(&save_safetensors(&dup, &file.0).unwrap_err());
        assert!(e.contains("appears twice"), "{e}");
        assert!(!file.0.exists());
        let e = save_safetensors(&[], Path::new("/nonexistent-dir/x/model.safetensors"));
        assert!(err_text(&e.unwrap_err()).contains("cannot write"));
    }

    #[test]
    fn human_bytes_formats() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1000), "1.00 kB");
        assert_eq!(human_bytes(12_345), "12.3 kB");
        assert_eq!(human_bytes(999_999), "1.00 MB");
        assert_eq!(human_bytes(1_498_484_736), "1.50 GB");
        assert_eq!(human_bytes(20 * GB), "20.0 GB");
        assert_eq!(human_bytes(123 * GB), "123 GB");
        assert_eq!(human_bytes(u64::MAX), "18.4 EB");
    }
}
