//! Deterministic synthetic data for tests and `layers-bench`: guest-memory
//! -like pages (zero runs, duplicated pages, compressible text and code,
//! random bytes), reproducible from a seed.

/// A tiny deterministic PRNG (SplitMix64). Not for cryptography.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// Page size used by the generators.
pub const PAGE: usize = 4096;

const WORDS: &[&str] = &[
    "import",
    "numpy",
    "def",
    "return",
    "self",
    "the",
    "of",
    "lambda",
    "value",
    "None",
    "True",
    "False",
    "class",
    "__init__",
    "for",
    "in",
    "range",
    "print",
    "sandbox",
    "agent",
    "/usr/lib/python3/dist-packages/",
    "json",
    "utf-8",
    "error",
    "0x7fff",
    "kernel",
];

/// What one page of guest memory looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    /// All zero.
    Zero,
    /// A copy of one of a small pool of pages (shared libraries, page
    /// tables, identical buffers).
    Duplicate,
    /// Text-like, compresses well.
    Text,
    /// Code/data-like: skewed byte distribution, compresses somewhat.
    Code,
    /// Random bytes (encrypted/compressed data), incompressible.
    Random,
}

/// Fills one page of the given kind.
pub fn fill_page(rng: &mut SplitMix64, kind: PageKind, page: &mut [u8]) {
    match kind {
        PageKind::Zero => page.fill(0),
        PageKind::Duplicate => {
            let mut pool = SplitMix64(0xD0B1_E000 + rng.below(64));
            fill_page(&mut pool, PageKind::Code, page);
        }
        PageKind::Text => {
            let mut p = 0;
            while p < page.len() {
                let w = WORDS[rng.below(WORDS.len() as u64) as usize].as_bytes();
                let n = w.len().min(page.len() - p);
                page[p..p + n].copy_from_slice(&w[..n]);
                p += n;
                if p < page.len() {
                    page[p] = if rng.chance(0.1) { b'\n' } else { b' ' };
                    p += 1;
                }
            }
        }
        PageKind::Code => {
            for b in page.iter_mut() {
                let r = rng.next_u64();
                // ~half the bytes are zero or small, the rest spread out.
                *b = if r & 1 == 0 {
                    ((r >> 8) & 0x7) as u8
                } else {
                    (r >> 16) as u8
                };
            }
        }
        PageKind::Random => rng.fill(page),
    }
}

/// Guest-memory-like content of `len` bytes (a multiple of [`PAGE`] is
/// best). Memory is modelled in 2 MiB regions: ~40% of regions are
/// untouched (all zero); in the others a page is zero 25%, a duplicate of a
/// pool page 16.7%, text 35%, code 17.5%, random 5.8%. Overall: ~55% zero,
/// ~10% duplicate, ~35% mixed text/code/random pages.
///
/// `emit(offset, page)` is called for every page that is not zero inside a
/// zero region, so a caller can write a sparse file.
pub fn guest_memory(seed: u64, len: u64, mut emit: impl FnMut(u64, &[u8])) {
    const REGION: u64 = 2 << 20;
    let mut rng = SplitMix64(seed);
    let mut page = vec![0u8; PAGE];
    let mut off = 0u64;
    while off < len {
        let region_end = (off + REGION).min(len);
        if rng.chance(0.40) {
            off = region_end;
            continue;
        }
        while off < region_end {
            let n = (region_end - off).min(PAGE as u64) as usize;
            let roll = rng.below(1000);
            let kind = match roll {
                0..250 => PageKind::Zero,
                250..417 => PageKind::Duplicate,
                417..767 => PageKind::Text,
                767..942 => PageKind::Code,
                _ => PageKind::Random,
            };
            fill_page(&mut rng, kind, &mut page[..n]);
            emit(off, &page[..n]);
            off += n as u64;
        }
    }
}

/// Test content with chunk-level structure: `len` bytes in `block`-sized
/// blocks, each all zero (25%), one of 8 seed-independent pool blocks
/// (25%, so different files share chunks), or fresh guest-memory-like data.
pub fn mixed_file(seed: u64, len: usize, block: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut rng = SplitMix64(seed ^ 0x5EED);
    for b in out.chunks_mut(block) {
        match rng.below(4) {
            0 => {}
            1 => {
                let k = rng.below(8);
                let mut pool = SplitMix64(0xB10C + k);
                let mut p = vec![0u8; block];
                for pg in p.chunks_mut(PAGE) {
                    fill_page(&mut pool, PageKind::Text, pg);
                }
                b.copy_from_slice(&p[..b.len()]);
            }
            _ => {
                guest_memory(rng.next_u64(), b.len() as u64, |off, pg| {
                    let o = off as usize;
                    b[o..o + pg.len()].copy_from_slice(pg);
                });
            }
        }
    }
    out
}

/// The content of snapshot `iter` of crash-test child `seed`: up to ~1.5 MB
/// of [`mixed_file`] data. Shared by the crash child and the crash test.
pub fn crash_content(seed: u64, iter: u64, block: usize) -> Vec<u8> {
    let mut r = SplitMix64(seed.wrapping_mul(1_000_003).wrapping_add(iter));
    let len = r.below(1_500_000) as usize;
    mixed_file(r.next_u64(), len, block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_roughly_shaped() {
        assert_eq!(mixed_file(7, 300_000, 65536), mixed_file(7, 300_000, 65536));
        let len = 64u64 << 20;
        let (mut zero, mut total) = (0u64, 0u64);
        guest_memory(1, len, |_, p| {
            total += p.len() as u64;
            if p.iter().all(|&b| b == 0) {
                zero += p.len() as u64;
            }
        });
        let zero_frac = (len - total + zero) as f64 / len as f64;
        assert!((0.4..0.7).contains(&zero_frac), "{zero_frac}");
    }
}
