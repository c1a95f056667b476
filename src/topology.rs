//! Which GPU pairs of a clique can reach each other directly, and over what.

use std::fmt;

/// How one GPU reaches another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Link {
    /// The same GPU.
    SelfLink,
    /// Peer access over NVLink (inferred: the pair supports native peer atomics, which PCIe
    /// peer access does not provide).
    NvLink,
    /// Peer access without native atomics: PCIe or a similar bridge.
    Pcie,
    /// No peer access: traffic goes through host memory.
    None,
}

impl Link {
    /// Short label for reports.
    pub fn label(self) -> &'static str {
        match self {
            Link::SelfLink => "X",
            Link::NvLink => "NV",
            Link::Pcie => "PCIe",
            Link::None => "-",
        }
    }

    /// Whether a kernel on one GPU can read and write the other's memory.
    pub fn has_p2p(self) -> bool {
        matches!(self, Link::SelfLink | Link::NvLink | Link::Pcie)
    }
}

/// The links between every pair of GPUs of a clique (rank order), with device names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    ordinals: Vec<usize>,
    names: Vec<String>,
    links: Vec<Vec<Link>>,
}

impl Topology {
    /// Builds a topology from a link matrix (`links[i][j]`: how rank i reaches rank j).
    ///
    /// # Panics
    /// If the matrix is not square with one row per ordinal.
    pub fn new(ordinals: Vec<usize>, names: Vec<String>, links: Vec<Vec<Link>>) -> Topology {
        let n = ordinals.len();
        assert!(names.len() == n && links.len() == n && links.iter().all(|r| r.len() == n));
        Topology {
            ordinals,
            names,
            links,
        }
    }

    /// Number of GPUs.
    pub fn len(&self) -> usize {
        self.ordinals.len()
    }

    /// Whether the topology has no GPU (never true for a clique's topology).
    pub fn is_empty(&self) -> bool {
        self.ordinals.is_empty()
    }

    /// CUDA ordinal of each rank.
    pub fn ordinals(&self) -> &[usize] {
        &self.ordinals
    }

    /// How rank `i` reaches rank `j`.
    pub fn link(&self, i: usize, j: usize) -> Link {
        self.links[i][j]
    }

    /// `Ok` when every pair has peer access and the links suit the P2P kernel (all NVLink, or
    /// exactly two GPUs); otherwise the reason, as a sentence.
    pub fn p2p_support(&self) -> Result<(), String> {
        let n = self.len();
        if let Some(why) = self.missing_peer_access() {
            return Err(why);
        }
        // Ranks of one device (`shared_devices`) reach each other through local memory.
        let all_nvlink = (0..n)
            .all(|i| (0..n).all(|j| matches!(self.links[i][j], Link::NvLink | Link::SelfLink)));
        if all_nvlink || n <= 2 {
            Ok(())
        } else {
            Err(format!(
                "{n} GPUs without NVLink between every pair: the root's PCIe link would be shared by all peers"
            ))
        }
    }
}

impl Topology {
    /// The first pair without peer access, as a sentence.
    pub(crate) fn missing_peer_access(&self) -> Option<String> {
        let n = self.len();
        (0..n)
            .flat_map(|i| (0..n).map(move |j| (i, j)))
            .find(|&(i, j)| !self.links[i][j].has_p2p())
            .map(|(i, j)| {
                format!(
                    "device {} cannot access device {} directly (no peer access)",
                    self.ordinals[i], self.ordinals[j]
                )
            })
    }
}

impl fmt::Display for Topology {
    /// A matrix in the style of `nvidia-smi topo -m`, then one line per GPU with its name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:>8}", "")?;
        for o in &self.ordinals {
            write!(f, "{:>6}", format!("GPU{o}"))?;
        }
        writeln!(f)?;
        for (i, o) in self.ordinals.iter().enumerate() {
            write!(f, "{:>8}", format!("GPU{o}"))?;
            for j in 0..self.len() {
                write!(f, "{:>6}", self.links[i][j].label())?;
            }
            writeln!(f)?;
        }
        for (o, name) in self.ordinals.iter().zip(&self.names) {
            writeln!(f, "GPU{o}: {name}")?;
        }
        write!(f, "Legend: NV = peer access over NVLink, PCIe = peer access without NVLink, - = no peer access")?;
        match self.p2p_support() {
            Ok(()) => write!(f, "\nP2P kernel: available"),
            Err(why) => write!(f, "\nP2P kernel: unavailable ({why})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(links: Vec<Vec<Link>>) -> Topology {
        let n = links.len();
        Topology::new(
            (0..n).collect(),
            (0..n).map(|i| format!("GPU model {i}")).collect(),
            links,
        )
    }

    #[test]
    fn nvlink_pair_supports_p2p_and_prints() {
        use Link::*;
        let t = topo(vec![vec![SelfLink, NvLink], vec![NvLink, SelfLink]]);
        assert!(t.p2p_support().is_ok());
        let s = t.to_string();
        assert!(
            s.contains("GPU0") && s.contains("NV") && s.contains("P2P kernel: available"),
            "{s}"
        );
    }

    #[test]
    fn missing_peer_access_is_reported() {
        use Link::*;
        let t = topo(vec![vec![SelfLink, None], vec![None, SelfLink]]);
        let why = t.p2p_support().unwrap_err();
        assert!(why.contains("no peer access"), "{why}");
        assert!(t.to_string().contains("unavailable"));
    }

    #[test]
    fn pcie_only_allowed_for_two_gpus() {
        use Link::*;
        let two = topo(vec![vec![SelfLink, Pcie], vec![Pcie, SelfLink]]);
        assert!(two.p2p_support().is_ok());
        let mut m = vec![vec![Pcie; 4]; 4];
        for (i, row) in m.iter_mut().enumerate() {
            row[i] = SelfLink;
        }
        assert!(topo(m.clone()).p2p_support().is_err());
        for (i, row) in m.iter_mut().enumerate() {
            for (j, l) in row.iter_mut().enumerate() {
                *l = if i == j { SelfLink } else { NvLink };
            }
        }
        assert!(topo(m).p2p_support().is_ok());
    }

    #[test]
    fn single_gpu_is_fine() {
        let t = topo(vec![vec![Link::SelfLink]]);
        assert!(t.p2p_support().is_ok());
        assert_eq!(t.len(), 1);
    }
}
