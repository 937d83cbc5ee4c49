//! Zigzag context-parallel layout (llama3 style), host side: index maps and exact row copies.
//!
//! A packed batch has sequences `b` with `cu_seqlens[b]..cu_seqlens[b+1]`. With `W` ranks each
//! sequence is cut into `2W` chunks of `C_b = len_b / (2W)` tokens; rank `r` holds chunks `r` and
//! `2W-1-r` of every sequence, back to back (its *local shard*, local cu_seqlens = cu_seqlens / W).
//! An all-gather of the local shards (rank-major, as `all_gather_into_tensor` writes them) gives
//! the *gathered zigzag buffer*:
//! `[rank 0: seq0 (c0, c2W-1), seq1 (c0, c2W-1), ..., rank 1: seq0 (c1, c2W-2), ...]`.
//!
//! `extract` turns the gathered buffer into each sequence's causal prefix (chunks `0..=max_chunk`
//! in original order, sequences concatenated); `scatter` is its backward (the rows it read get the
//! gradient, every other row zero). Both are plain row copies: exact for any dtype.

use rayon::prelude::*;

use crate::error::{invalid, Result};

/// Checks `cu_seqlens` (starts at 0, non-decreasing) and that every sequence splits into `2W`
/// equal chunks; returns the chunk length of each sequence.
pub fn chunk_lengths(cu_seqlens: &[i32], world_size: usize) -> Result<Vec<usize>> {
    if world_size == 0 {
        return Err(invalid("world_size", "must be at least 1, got 0"));
    }
    if cu_seqlens.is_empty() {
        return Err(invalid("cu_seqlens", "needs at least one value (batch + 1 entries), got 0"));
    }
    if cu_seqlens[0] != 0 {
        return Err(invalid("cu_seqlens", format!("must start at 0, got {}", cu_seqlens[0])));
    }
    let parts = 2 * world_size;
    let mut out = Vec::with_capacity(cu_seqlens.len() - 1);
    for b in 0..cu_seqlens.len() - 1 {
        let len = cu_seqlens[b + 1] as i64 - cu_seqlens[b] as i64;
        if len < 0 {
            return Err(invalid(
                "cu_seqlens",
                format!("must be non-decreasing: sequence {b} has length {len}"),
            ));
        }
        if len as usize % parts != 0 {
            return Err(invalid(
                "cu_seqlens",
                format!(
                    "sequence {b} has length {len}, not a multiple of 2 * world_size = {parts} \
                     (zigzag splits each sequence into {parts} equal chunks; pad it to a multiple of {parts})"
                ),
            ));
        }
        out.push(len as usize / parts);
    }
    Ok(out)
}

/// The local shard's cu_seqlens: every sequence keeps `2 * C_b` tokens on each rank.
pub fn local_cu_seqlens(cu_seqlens: &[i32], world_size: usize) -> Result<Vec<i32>> {
    let chunks = chunk_lengths(cu_seqlens, world_size)?;
    let mut out = Vec::with_capacity(cu_seqlens.len());
    out.push(0i32);
    let mut acc = 0usize;
    for c in chunks {
        acc += 2 * c;
        out.push(acc as i32);
    }
    Ok(out)
}

/// Row of the full packed batch for each row of rank `rank`'s local shard.
pub fn shard_rows(cu_seqlens: &[i32], world_size: usize, rank: usize) -> Result<Vec<usize>> {
    let chunks = chunk_lengths(cu_seqlens, world_size)?;
    if rank >= world_size {
        return Err(invalid("rank", format!("must be in 0..{world_size}, got {rank}")));
    }
    let mut rows = Vec::with_capacity(cu_seqlens[cu_seqlens.len() - 1] as usize / world_size);
    for (b, &c) in chunks.iter().enumerate() {
        let start = cu_seqlens[b] as usize;
        for j in [rank, 2 * world_size - 1 - rank] {
            rows.extend(start + j * c..start + (j + 1) * c);
        }
    }
    Ok(rows)
}

/// Row of the gathered zigzag buffer for each row of the extracted prefixes: per sequence the
/// chunks `0..=max_chunk` in original order, sequences one after the other.
pub fn gathered_rows(cu_seqlens: &[i32], world_size: usize, max_chunk: usize) -> Result<Vec<usize>> {
    let chunks = chunk_lengths(cu_seqlens, world_size)?;
    let parts = 2 * world_size;
    if max_chunk >= parts {
        return Err(invalid("max_chunk_idx", format!("must be in 0..{parts} (2 * world_size chunks), got {max_chunk}")));
    }
    let block = cu_seqlens[cu_seqlens.len() - 1] as usize / world_size; // tokens per rank
    let mut rows = Vec::with_capacity(chunks.iter().map(|c| c * (max_chunk + 1)).sum());
    let mut local = 0usize; // sequence start inside a rank's shard
    for &c in &chunks {
        for j in 0..=max_chunk {
            let (owner, second) = if j < world_size { (j, 0) } else { (parts - 1 - j, 1) };
            let s = owner * block + local + second * c;
            rows.extend(s..s + c);
        }
        local += 2 * c;
    }
    Ok(rows)
}

fn check_rows(src_len: usize, row_bytes: usize, arg: &'static str) -> Result<usize> {
    if row_bytes == 0 {
        return Err(invalid("row_bytes", "must be positive"));
    }
    if src_len % row_bytes != 0 {
        return Err(invalid(arg, format!("has {src_len} bytes, not a multiple of the row size {row_bytes}")));
    }
    Ok(src_len / row_bytes)
}

/// `out[i] = src[rows[i]]`, rows of `row_bytes` bytes.
pub fn extract(src: &[u8], row_bytes: usize, rows: &[usize]) -> Result<Vec<u8>> {
    let n = check_rows(src.len(), row_bytes, "kv")?;
    if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
        return Err(invalid("kv", format!("has {n} rows but row {bad} is needed: is it the gathered buffer of all ranks?")));
    }
    let mut out = vec![0u8; rows.len() * row_bytes];
    out.par_chunks_mut(row_bytes).zip(rows.par_iter()).for_each(|(o, &r)| {
        o.copy_from_slice(&src[r * row_bytes..(r + 1) * row_bytes]);
    });
    Ok(out)
}

/// The backward of [`extract`] for distinct `rows`: `out[rows[i]] = src[i]`, other rows zero;
/// `out` has `total_rows` rows.
pub fn scatter(src: &[u8], row_bytes: usize, rows: &[usize], total_rows: usize) -> Result<Vec<u8>> {
    let n = check_rows(src.len(), row_bytes, "grad")?;
    if n != rows.len() {
        return Err(invalid("grad", format!("has {n} rows; the extracted prefixes have {}", rows.len())));
    }
    if let Some(&bad) = rows.iter().find(|&&r| r >= total_rows) {
        return Err(invalid("total_rows", format!("is {total_rows} but row {bad} is written")));
    }
    let mut out = vec![0u8; total_rows * row_bytes];
    for (i, &r) in rows.iter().enumerate() {
        out[r * row_bytes..(r + 1) * row_bytes].copy_from_slice(&src[i * row_bytes..(i + 1) * row_bytes]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_of_all_ranks_gathered_and_extracted_give_the_sequence_back() {
        let cu = [0, 24, 36, 84];
        for w in 1..=3usize {
            let mut gathered = Vec::new();
            for r in 0..w {
                gathered.extend(shard_rows(&cu, w, r).unwrap());
            }
            assert_eq!(gathered.len(), 84);
            let full = gathered_rows(&cu, w, 2 * w - 1).unwrap();
            let natural: Vec<usize> = full.iter().map(|&g| gathered[g]).collect();
            assert_eq!(natural, (0..84).collect::<Vec<_>>(), "W={w}");
            // a prefix: chunks 0..=m of each sequence
            for m in 0..2 * w {
                let pre: Vec<usize> = gathered_rows(&cu, w, m).unwrap().iter().map(|&g| gathered[g]).collect();
                let mut want = Vec::new();
                for b in 0..3 {
                    let c = (cu[b + 1] - cu[b]) as usize / (2 * w);
                    want.extend(cu[b] as usize..cu[b] as usize + (m + 1) * c);
                }
                assert_eq!(pre, want, "W={w} m={m}");
            }
        }
    }

    #[test]
    fn local_cu_seqlens_and_errors() {
        assert_eq!(local_cu_seqlens(&[0, 8, 24], 2).unwrap(), vec![0, 4, 12]);
        let e = chunk_lengths(&[0, 8, 18], 2).unwrap_err().to_string();
        assert!(e.contains("sequence 1") && e.contains("multiple of 2 * world_size = 4"), "{e}");
        assert!(chunk_lengths(&[1, 8], 1).is_err());
        assert!(chunk_lengths(&[0, 8, 4], 1).is_err());
        assert!(chunk_lengths(&[0, 8], 0).is_err());
        assert!(shard_rows(&[0, 8], 2, 2).is_err());
        assert!(gathered_rows(&[0, 8], 2, 4).is_err());
    }

    #[test]
    fn extract_then_scatter_is_exact() {
        let cu = [0, 12, 24];
        let rows = gathered_rows(&cu, 3, 2).unwrap();
        let src: Vec<u8> = (0..24 * 4).map(|i| (i * 7 % 251) as u8).collect();
        let ex = extract(&src, 4, &rows).unwrap();
        for (i, &r) in rows.iter().enumerate() {
            assert_eq!(&ex[i * 4..i * 4 + 4], &src[r * 4..r * 4 + 4]);
        }
        let back = scatter(&ex, 4, &rows, 24).unwrap();
        for r in 0..24 {
            let want: &[u8] = if rows.contains(&r) { &src[r * 4..r * 4 + 4] } else { &[0; 4] };
            assert_eq!(&back[r * 4..r * 4 + 4], want);
        }
        assert!(extract(&src[..20], 4, &rows).is_err());
        assert!(scatter(&ex[..4], 4, &rows, 24).is_err());
    }
}
