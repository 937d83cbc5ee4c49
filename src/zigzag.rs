//! Zigzag context-parallel layout (llama3 style), host side: index maps and exact row copies.
//!
//! A packed batch has sequences `b` with `cu_seqlens[b]..cu_seqlens[b+1]`, of any lengths. With
//! `W` ranks each sequence of `L` tokens is cut into `2W` chunks, in order; with `L = 2W q + m`
//! (`0 <= m < 2W`) the first `m` chunks hold `q + 1` tokens and the others `q` ([`chunk`]).
//! Rank `r` holds chunks `r` and `2W-1-r` of every sequence, back to back (its *local shard*;
//! its cu_seqlens are [`local_cu_seqlens`]). The ranks' shards differ in length by at most one
//! token per sequence (none when every length is a multiple of `2W`: then the local cu_seqlens are
//! `cu_seqlens / W` on every rank).
//!
//! An all-gather of the local shards, each padded at its end to [`rank_rows`] rows (the longest
//! shard; collectives move equal blocks), gives the *gathered zigzag buffer* of
//! [`gathered_len`] rows, rank-major as `all_gather_into_tensor` writes it:
//! `[rank 0: seq0 (c0, c2W-1), seq1 (c0, c2W-1), ..., padding, rank 1: seq0 (c1, c2W-2), ...]`.
//!
//! `extract` turns the gathered buffer into each sequence's causal prefix (chunks `0..=max_chunk`
//! in original order, sequences concatenated); `scatter` is its backward (the rows it read get the
//! gradient, every other row zero). Both are plain row copies: exact for any dtype.

use rayon::prelude::*;

use crate::error::{invalid, Result};

/// Checks `cu_seqlens` (starts at 0, non-decreasing) and `world_size` (at least 1); returns the
/// sequence lengths.
pub fn seq_lengths(cu_seqlens: &[i32], world_size: usize) -> Result<Vec<usize>> {
    if world_size == 0 {
        return Err(invalid("world_size", "must be at least 1, got 0"));
    }
    if cu_seqlens.is_empty() {
        return Err(invalid("cu_seqlens", "needs at least one value (batch + 1 entries), got 0"));
    }
    if cu_seqlens[0] != 0 {
        return Err(invalid("cu_seqlens", format!("must start at 0, got {}", cu_seqlens[0])));
    }
    let mut out = Vec::with_capacity(cu_seqlens.len() - 1);
    for b in 0..cu_seqlens.len() - 1 {
        let len = cu_seqlens[b + 1] as i64 - cu_seqlens[b] as i64;
        if len < 0 {
            return Err(invalid(
                "cu_seqlens",
                format!("must be non-decreasing: sequence {b} has length {len}"),
            ));
        }
        out.push(len as usize);
    }
    Ok(out)
}

/// Chunk `j` of a sequence of `len` tokens cut into `parts` chunks: `(start, length)`. The first
/// `len % parts` chunks hold one token more than the others.
pub fn chunk(len: usize, parts: usize, j: usize) -> (usize, usize) {
    let (q, m) = (len / parts, len % parts);
    (j * q + j.min(m), q + usize::from(j < m))
}

/// Tokens of a sequence of `len` tokens in rank `rank`'s shard (chunks `rank` and `2W-1-rank`).
pub fn local_len(len: usize, world_size: usize, rank: usize) -> usize {
    let parts = 2 * world_size;
    chunk(len, parts, rank).1 + chunk(len, parts, parts - 1 - rank).1
}

/// Each rank's shard length (`world_size` values).
fn shard_lengths(lens: &[usize], world_size: usize) -> Vec<usize> {
    (0..world_size).map(|r| lens.iter().map(|&n| local_len(n, world_size, r)).sum()).collect()
}

/// Rows of one rank's block in the gathered buffer: the longest shard.
pub fn rank_rows(cu_seqlens: &[i32], world_size: usize) -> Result<usize> {
    let lens = seq_lengths(cu_seqlens, world_size)?;
    Ok(shard_lengths(&lens, world_size).into_iter().max().unwrap_or(0))
}

/// Rows of the gathered buffer: `world_size` blocks of [`rank_rows`] (the total token count when
/// every length is a multiple of `2W`).
pub fn gathered_len(cu_seqlens: &[i32], world_size: usize) -> Result<usize> {
    Ok(world_size * rank_rows(cu_seqlens, world_size)?)
}

fn check_rank(world_size: usize, rank: usize) -> Result<()> {
    if rank >= world_size {
        return Err(invalid("rank", format!("must be in 0..{world_size}, got {rank}")));
    }
    Ok(())
}

/// The local shard's cu_seqlens of rank `rank`. Without a rank (`None`) every sequence must be a
/// multiple of `2W` tokens, where all ranks' local cu_seqlens are `cu_seqlens / W`.
pub fn local_cu_seqlens(cu_seqlens: &[i32], world_size: usize, rank: Option<usize>) -> Result<Vec<i32>> {
    let lens = seq_lengths(cu_seqlens, world_size)?;
    let parts = 2 * world_size;
    if let Some(r) = rank {
        check_rank(world_size, r)?;
    } else if let Some((b, n)) = lens.iter().enumerate().find(|(_, &n)| n % parts != 0) {
        return Err(invalid(
            "rank",
            format!(
                "is needed: sequence {b} has length {n}, not a multiple of 2 * world_size = {parts}, so the \
                 ranks' local cu_seqlens differ (pass this rank's `rank`, and `full_cu_seqlens` to the layer)"
            ),
        ));
    }
    let mut out = Vec::with_capacity(cu_seqlens.len());
    out.push(0i32);
    let mut acc = 0usize;
    for n in lens {
        acc += rank.map_or(n / world_size, |r| local_len(n, world_size, r));
        out.push(acc as i32);
    }
    Ok(out)
}

/// Row of the full packed batch for each row of rank `rank`'s local shard.
pub fn shard_rows(cu_seqlens: &[i32], world_size: usize, rank: usize) -> Result<Vec<usize>> {
    let lens = seq_lengths(cu_seqlens, world_size)?;
    check_rank(world_size, rank)?;
    let parts = 2 * world_size;
    let mut rows = Vec::with_capacity(lens.iter().map(|&n| local_len(n, world_size, rank)).sum());
    for (b, &n) in lens.iter().enumerate() {
        let start = cu_seqlens[b] as usize;
        for j in [rank, parts - 1 - rank] {
            let (s, c) = chunk(n, parts, j);
            rows.extend(start + s..start + s + c);
        }
    }
    Ok(rows)
}

/// Row of the gathered zigzag buffer for each row of the extracted prefixes: per sequence the
/// chunks `0..=max_chunk` in original order, sequences one after the other.
pub fn gathered_rows(cu_seqlens: &[i32], world_size: usize, max_chunk: usize) -> Result<Vec<usize>> {
    let lens = seq_lengths(cu_seqlens, world_size)?;
    let parts = 2 * world_size;
    if max_chunk >= parts {
        return Err(invalid("max_chunk_idx", format!("must be in 0..{parts} (2 * world_size chunks), got {max_chunk}")));
    }
    let block = shard_lengths(&lens, world_size).into_iter().max().unwrap_or(0); // rows per rank
    let prefix = |n: usize| {
        let (s, c) = chunk(n, parts, max_chunk);
        s + c
    };
    let mut rows = Vec::with_capacity(lens.iter().map(|&n| prefix(n)).sum());
    let mut local = vec![0usize; world_size]; // sequence start inside each rank's shard
    for &n in &lens {
        for j in 0..=max_chunk {
            let (owner, second) = if j < world_size { (j, false) } else { (parts - 1 - j, true) };
            // the second chunk of a rank follows its first one
            let s = owner * block + local[owner] + if second { chunk(n, parts, owner).1 } else { 0 };
            rows.extend(s..s + chunk(n, parts, j).1);
        }
        for (r, at) in local.iter_mut().enumerate() {
            *at += local_len(n, world_size, r);
        }
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

    /// The gathered buffer of full-batch rows: every rank's shard padded to `rank_rows`
    /// (`usize::MAX` marks a padding row).
    fn gathered_of(cu: &[i32], w: usize) -> Vec<usize> {
        let block = rank_rows(cu, w).unwrap();
        let mut out = Vec::new();
        for r in 0..w {
            let rows = shard_rows(cu, w, r).unwrap();
            assert!(rows.len() <= block);
            out.extend(rows.iter().copied().chain(std::iter::repeat_n(usize::MAX, block - rows.len())));
        }
        assert_eq!(out.len(), gathered_len(cu, w).unwrap());
        out
    }

    #[test]
    fn chunks_cover_the_sequence_in_order_and_differ_by_at_most_one() {
        for parts in [2usize, 4, 6, 8] {
            for len in 0..40usize {
                let mut at = 0;
                let sizes: Vec<usize> = (0..parts).map(|j| chunk(len, parts, j)).map(|(s, c)| {
                    assert_eq!(s, at);
                    at += c;
                    c
                }).collect();
                assert_eq!(at, len);
                assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{len} {parts}");
            }
        }
    }

    #[test]
    fn shards_of_all_ranks_gathered_and_extracted_give_the_sequence_back() {
        // multiples of 2W (W = 1..3) and arbitrary lengths: 1-token, 7, 13, empty, shorter than 2W
        for cu in [vec![0, 24, 36, 84], vec![0, 1, 8, 21, 21, 22, 1022]] {
            let total = *cu.last().unwrap() as usize;
            for w in 1..=4usize {
                let gathered = gathered_of(&cu, w);
                let full = gathered_rows(&cu, w, 2 * w - 1).unwrap();
                let natural: Vec<usize> = full.iter().map(|&g| gathered[g]).collect();
                assert_eq!(natural, (0..total).collect::<Vec<_>>(), "W={w} cu={cu:?}");
                let mut shards: Vec<usize> = (0..w).flat_map(|r| shard_rows(&cu, w, r).unwrap()).collect();
                shards.sort_unstable();
                assert_eq!(shards, (0..total).collect::<Vec<_>>(), "every row on exactly one rank");
                for r in 0..w {
                    let local = local_cu_seqlens(&cu, w, Some(r)).unwrap();
                    assert_eq!(*local.last().unwrap() as usize, shard_rows(&cu, w, r).unwrap().len());
                }
                // a prefix: chunks 0..=m of each sequence
                for m in 0..2 * w {
                    let pre: Vec<usize> = gathered_rows(&cu, w, m).unwrap().iter().map(|&g| gathered[g]).collect();
                    let mut want = Vec::new();
                    for b in 0..cu.len() - 1 {
                        let (s, c) = chunk((cu[b + 1] - cu[b]) as usize, 2 * w, m);
                        want.extend(cu[b] as usize..cu[b] as usize + s + c);
                    }
                    assert_eq!(pre, want, "W={w} m={m}");
                }
            }
        }
    }

    #[test]
    fn local_cu_seqlens_and_errors() {
        assert_eq!(local_cu_seqlens(&[0, 8, 24], 2, None).unwrap(), vec![0, 4, 12]);
        assert_eq!(local_cu_seqlens(&[0, 8, 24], 2, Some(1)).unwrap(), vec![0, 4, 12]);
        // 13 tokens over 4 chunks: 4, 3, 3, 3; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        assert_eq!(local_cu_seqlens(&[0, 13, 14], 2, Some(0)).unwrap(), vec![0, 7, 8]);
        assert_eq!(local_cu_seqlens(&[0, 13, 14], 2, Some(1)).unwrap(), vec![0, 6, 6]);
        assert_eq!(rank_rows(&[0, 13, 14], 2).unwrap(), 8);
        let e = local_cu_seqlens(&[0, 8, 18], 2, None).unwrap_err().to_string();
        assert!(e.contains("`rank`") && e.contains("sequence 1") && e.contains("2 * world_size = 4"), "{e}");
        assert!(seq_lengths(&[1, 8], 1).is_err());
        assert!(seq_lengths(&[0, 8, 4], 1).is_err());
        assert!(seq_lengths(&[0, 8], 0).is_err());
        assert!(seq_lengths(&[], 1).is_err());
        assert!(shard_rows(&[0, 8], 2, 2).is_err());
        assert!(local_cu_seqlens(&[0, 8], 2, Some(2)).is_err());
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
