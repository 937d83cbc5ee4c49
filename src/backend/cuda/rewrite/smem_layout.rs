//! Shared-memory layout: CubeCL places a kernel's shared buffers in the iteration order of a hash
//! set, which differs from process to process, so the same kernel compiled twice got different
//! buffer offsets (and a user's disk cache kept whichever came first). [`smem_layout`] places them
//! in declaration order instead: one layout per kernel source, whoever compiles it.

use super::mismatch;
use crate::error::Result;

/// The most dynamic shared memory a block can opt into on any GPU we target (sm_90: 227 KiB).
const MOST_SHARED: usize = 227 * 1024;

/// Places the shared buffers of kernel `entry` one after the other in the order of their ids
/// (CubeCL numbers them in creation order), each aligned to the alignment CubeCL declared for the
/// dynamic shared memory, or, where that would exceed [`MOST_SHARED`], to the largest power of two
/// dividing its size (at least 16 bytes, at most that alignment), so that barriers and small tables
/// do not take a 1024-byte slot each. Returns the source and the bytes of shared memory it needs. A
/// buffer declaration of another form is refused; a kernel without shared memory is unchanged.
pub(crate) fn smem_layout(entry: &str, src: &str) -> Result<(String, u32)> {
    let bad = |what: &str| mismatch(entry, "smem_layout", what);
    const DYN: &str = " uint8 dynamic_shared_mem[];";
    let Some(dyn_at) = src.find(DYN) else {
        if src.contains("dynamic_shared_mem") {
            return Err(bad("shared memory without the `extern __shared__ __align__(N) uint8` array"));
        }
        return Ok((src.to_string(), 0));
    };
    let align: usize = src[..dyn_at]
        .rsplit_once("__align__(")
        .and_then(|(_, a)| a.strip_suffix(')'))
        .and_then(|a| a.parse().ok())
        .filter(|a: &usize| a.is_power_of_two())
        .ok_or_else(|| bad("no `__align__(N)` on the dynamic shared memory"))?;
    let lines: Vec<&str> = src.lines().collect();
    // (id, bytes, line of the declaration, text before and after the offset)
    let mut bufs = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(at) = line.find("dynamic_shared_mem[").filter(|_| !line.ends_with(DYN)) else { continue };
        if i == 0 || !line.contains(" = reinterpret_cast<") {
            return Err(bad(&format!("a use of the shared memory that is not a buffer declaration: `{line}`")));
        }
        let bytes = lines[i - 1]
            .strip_prefix("// Shared array size: ")
            .and_then(|c| c.split_once(", "))
            .map(|(_, b)| b)
            .or_else(|| lines[i - 1].strip_prefix("// Shared value size: "))
            .and_then(|b| b.strip_suffix(" bytes"))
            .and_then(|b| b.parse::<usize>().ok())
            .ok_or_else(|| bad(&format!("a buffer without its size comment: `{line}`")))?;
        let id = line
            .split_once("shared_memory_")
            .and_then(|(_, r)| r.split_once(' '))
            .and_then(|(n, _)| n.parse::<u32>().ok())
            .ok_or_else(|| bad(&format!("a buffer that is not `shared_memory_N`: `{line}`")))?;
        let open = at + "dynamic_shared_mem[".len();
        let close = line[open..].find(']').map(|c| open + c).ok_or_else(|| bad(&format!("an unterminated offset: `{line}`")))?;
        if line[open..close].parse::<usize>().is_err() {
            return Err(bad(&format!("an offset that is not a number: `{line}`")));
        }
        bufs.push((id, bytes, i, open, close));
    }
    bufs.sort_by_key(|b| b.0);
    // each buffer at the kernel's alignment; a kernel that would then ask for more than any GPU
    // gives a block (227 KiB on sm_90) packs each buffer at the largest power of two dividing its
    // size, from 16 up to the kernel's (a swizzled tile is a whole number of its swizzle atoms; a
    // barrier or a small table needs no more than 16): only such kernels change layout
    let place = |own: bool| {
        let mut at = 0usize;
        let offs: Vec<usize> = bufs
            .iter()
            .map(|&(_, bytes, ..)| {
                let a = if own { (1usize << bytes.trailing_zeros().min(align.trailing_zeros())).clamp(16, align) } else { align };
                let off = at.next_multiple_of(a);
                at = off + bytes;
                off
            })
            .collect();
        (offs, at.next_multiple_of(align))
    };
    let (mut offs, mut at) = place(false);
    if at > MOST_SHARED {
        (offs, at) = place(true);
    }
    let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    for (&(_, _, i, open, close), off) in bufs.iter().zip(offs) {
        out[i] = format!("{}{off}{}", &lines[i][..open], &lines[i][close..]);
    }
    let mut text = out.join("\n");
    if src.ends_with('\n') {
        text.push('\n');
    }
    let total = u32::try_from(at).map_err(|_| bad("more shared memory than a u32 counts"))?;
    Ok((text, total))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three buffers as CubeCL lays them out (in hash order).
    const LAYOUT: &str = "extern __shared__ __align__(16) uint8 dynamic_shared_mem[];\n\
        // Shared array size: 4, 8 bytes\n\
        float *shared_memory_9 = reinterpret_cast<float*>(&dynamic_shared_mem[0]);\n\
        // Shared value size: 8 bytes\n\
        cuda::barrier<cuda::thread_scope_block> &shared_memory_2 = reinterpret_cast<cuda::barrier<cuda::thread_scope_block>&>(dynamic_shared_mem[16]);\n\
        // Shared array size: 40, 80 bytes\n\
        __half *shared_memory_5 = reinterpret_cast<__half*>(&dynamic_shared_mem[32]);\n";

    #[test]
    fn shared_layout_in_declaration_order() {
        let (out, total) = smem_layout("k", LAYOUT).unwrap();
        assert!(out.contains("&shared_memory_2 = reinterpret_cast<cuda::barrier<cuda::thread_scope_block>&>(dynamic_shared_mem[0]);"), "{out}");
        assert!(out.contains("*shared_memory_5 = reinterpret_cast<__half*>(&dynamic_shared_mem[16]);"), "{out}");
        assert!(out.contains("*shared_memory_9 = reinterpret_cast<float*>(&dynamic_shared_mem[96]);"), "{out}");
        assert_eq!(total, 112);
        assert_eq!(smem_layout("k", "no shared memory").unwrap(), ("no shared memory".to_string(), 0));
    }

    #[test]
    fn small_buffers_pack_only_where_the_padded_layout_does_not_fit() {
        // two tiles of 113 KiB with a barrier and a 512-byte table between them: 228 KiB padded
        let t = 113 * 1024;
        let src = format!(
            "extern __shared__ __align__(1024) uint8 dynamic_shared_mem[];\n\
            // Shared array size: {h}, {t} bytes\n\
            __half *shared_memory_1 = reinterpret_cast<__half*>(&dynamic_shared_mem[0]);\n\
            // Shared value size: 8 bytes\n\
            cuda::barrier<cuda::thread_scope_block> &shared_memory_2 = reinterpret_cast<cuda::barrier<cuda::thread_scope_block>&>(dynamic_shared_mem[{t}]);\n\
            // Shared array size: 128, 512 bytes\n\
            float *shared_memory_3 = reinterpret_cast<float*>(&dynamic_shared_mem[{b}]);\n\
            // Shared array size: {h}, {t} bytes\n\
            __half *shared_memory_4 = reinterpret_cast<__half*>(&dynamic_shared_mem[{c}]);\n",
            h = t / 2,
            b = t + 1024,
            c = t + 2048
        );
        let (out, total) = smem_layout("k", &src).unwrap();
        // the barrier right after the tile, the table at a multiple of 512, the next tile at 1024
        assert!(out.contains(&format!("(dynamic_shared_mem[{t}]);")), "{out}");
        assert!(out.contains(&format!("float*>(&dynamic_shared_mem[{}]);", t + 512)), "{out}");
        assert!(out.contains(&format!("__half*>(&dynamic_shared_mem[{}]);", t + 1024)) && out.contains("shared_memory_4"), "{out}");
        assert_eq!(total as usize, 2 * t + 1024);
        // a kernel that fits padded keeps every buffer at the kernel's alignment
        let small = src.replace(&t.to_string(), "4096").replace(&(t / 2).to_string(), "2048");
        let (out, total) = smem_layout("k", &small).unwrap();
        assert!(out.contains("(dynamic_shared_mem[4096]);") && out.contains("float*>(&dynamic_shared_mem[5120]);"), "{out}");
        assert!(out.contains("__half*>(&dynamic_shared_mem[6144]);"), "{out}");
        assert_eq!(total, 10240);
    }

    #[test]
    fn refuses_other_declarations() {
        // a size comment or a declaration of another form is refused
        assert!(smem_layout("k", &LAYOUT.replace("// Shared value size: 8 bytes\n", "")).is_err());
        assert!(smem_layout("k", &format!("{LAYOUT}x = dynamic_shared_mem[3];\n")).is_err());
        assert!(smem_layout("k", &LAYOUT.replace("__align__(16) ", "")).is_err());
    }
}
