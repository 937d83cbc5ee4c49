//! Element types and host buffers (views in, owned data out).

use half::{bf16, f16};

/// Element type of q, k, v, out and the gradients. LSE is always f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }
    pub fn parse(s: &str) -> Option<DType> {
        match s {
            "float32" | "f32" | "fp32" => Some(DType::F32),
            "float16" | "f16" | "fp16" | "half" => Some(DType::F16),
            "bfloat16" | "bf16" => Some(DType::BF16),
            _ => None,
        }
    }
}

/// A scalar the kernels read and write; math is always done in f32 (or f64 for the reference).
pub trait Element: Copy + Send + Sync + Default + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}
impl Element for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Borrowed host data of one of the supported dtypes.
#[derive(Debug, Clone, Copy)]
pub enum HostView<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

/// Owned host data of one of the supported dtypes.
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl<'a> HostView<'a> {
    pub fn dtype(&self) -> DType {
        match self {
            HostView::F32(_) => DType::F32,
            HostView::F16(_) => DType::F16,
            HostView::BF16(_) => DType::BF16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            HostView::F32(s) => s.len(),
            HostView::F16(s) => s.len(),
            HostView::BF16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Raw bytes (native endianness), for uploads to a device.
    pub fn as_bytes(&self) -> &'a [u8] {
        match *self {
            HostView::F32(s) => bytemuck::cast_slice(s),
            HostView::F16(s) => bytemuck::cast_slice(s),
            HostView::BF16(s) => bytemuck::cast_slice(s),
        }
    }
    /// Every element widened to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            HostView::F32(s) => s.to_vec(),
            HostView::F16(s) => s.iter().map(|x| x.to_f32()).collect(),
            HostView::BF16(s) => s.iter().map(|x| x.to_f32()).collect(),
        }
    }
    /// Every element widened to f64 (reference computations).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.to_f32_vec().into_iter().map(f64::from).collect()
    }
}

impl HostData {
    pub fn view(&self) -> HostView<'_> {
        match self {
            HostData::F32(v) => HostView::F32(v),
            HostData::F16(v) => HostView::F16(v),
            HostData::BF16(v) => HostView::BF16(v),
        }
    }
    pub fn dtype(&self) -> DType {
        self.view().dtype()
    }
    pub fn len(&self) -> usize {
        self.view().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.view().to_f32_vec()
    }
    /// Round f32 values into `dtype`.
    pub fn from_f32(dtype: DType, xs: &[f32]) -> HostData {
        match dtype {
            DType::F32 => HostData::F32(xs.to_vec()),
            DType::F16 => HostData::F16(xs.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::BF16 => HostData::BF16(xs.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }
    /// Reinterpret raw bytes (native endianness) as `dtype` elements.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> HostData {
        match dtype {
            DType::F32 => HostData::F32(bytemuck::pod_collect_to_vec(bytes)),
            DType::F16 => HostData::F16(bytemuck::pod_collect_to_vec(bytes)),
            DType::BF16 => HostData::BF16(bytemuck::pod_collect_to_vec(bytes)),
        }
    }
}
