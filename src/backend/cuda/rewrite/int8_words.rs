//! CubeCL's 4 x int8 vector as one 32-bit word, for the INT8 forward ([`int8_words`]).

use super::mismatch;
use crate::error::Result;

/// CubeCL's 4 x int8 vector (the int8 `mma.sync` fragment register) as it prints it.
const INT8_4: &str = "struct __align__(4) int8_4 {\n    int8 i_0;\n    int8 i_1;\n    int8 i_2;\n    int8 i_3;\n};";

/// The int8 forward (`int8_qk`) only moves whole 4 x int8 vectors between 32-bit words and the
/// `mma` operands (reinterpret casts, never a byte): CubeCL's struct of four `int8` makes NVRTC
/// split every copy into bytes and repack them (6 PRMT + shifts per IMMA; 2844 -> 1999
/// instructions per key tile at d128 with one 32-bit member). The struct becomes one `uint32`;
/// a kernel that reads a byte member (`.i_0`..`.i_3` of an `int8_4`) would no longer compile, so
/// a mistake here cannot pass silently.
pub(crate) fn int8_words(entry: &str, src: &str) -> Result<String> {
    if !src.contains(INT8_4) {
        return Err(mismatch(entry, "int8_words", "no `int8_4` struct"));
    }
    Ok(src.replacen(INT8_4, "struct __align__(4) int8_4 {\n    uint32 w;\n};", 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_vectors_become_words() {
        let src = format!("x\n{INT8_4}\ny");
        assert_eq!(int8_words("k", &src).unwrap(), "x\nstruct __align__(4) int8_4 {\n    uint32 w;\n};\ny");
    }

    #[test]
    fn refuses_a_kernel_without_the_struct() {
        assert!(int8_words("k", "struct int8_4 { int8 a; };").is_err());
    }
}
