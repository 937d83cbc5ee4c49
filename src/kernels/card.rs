//! Kernel cards: the runtime arguments of a kernel family written once (`kernels::cards`), as one
//! struct parameter of each kernel of the family and as the host's launch arguments
//! (`backend::cuda::card`).
//!
//! A card lists its fields in the kernel's declaration order, each with a kind: `map` (a tensor
//! map), `read` (an array the kernel only reads), `write` (an array it writes) or `scalar` (an
//! `f32` or `u32`). [`device_card!`] makes it a `#[derive(CubeType, CubeLaunch)]` struct that a
//! kernel takes as `args: &mut Card<..>`. CubeCL expands a struct parameter field by field in
//! declaration order, so the generated CUDA signature is the one the same fields written as
//! separate parameters give: tensor maps, then one pointer per array, then the scalars grouped by
//! type. A `&mut` parameter expands every field as an output; [`In`] keeps a `map` or `read` field
//! an input (a `const __restrict__` pointer), as a `&` parameter would. (CubeCL 0.10: the derived
//! `LaunchArg::expand` / `expand_output` expand the fields in order, cubecl-macros
//! `generate/cube_type/generate_struct.rs`; `KernelBuilder` numbers the buffers in that order,
//! cubecl-core `compute/builder.rs`; the `const __restrict__` of inputs, cubecl-cpp
//! `shared/kernel.rs`.)

use core::marker::PhantomData;

use cubecl::prelude::*;

/// A card field the kernel only reads: expanded as an input even inside a `&mut` card (its
/// `LaunchArg::expand_output` is `T::expand`). In the kernel the field is a `T`.
pub struct In<T>(PhantomData<fn() -> T>);

/// The plain (never run) copy of a kernel that `#[cube]` type-checks sees an `In<T>` field as a `T`.
impl<T> core::ops::Deref for In<T> {
    type Target = T;

    fn deref(&self) -> &T {
        cubecl::unexpanded!()
    }
}

impl<T: CubeType> CubeType for In<T> {
    type ExpandType = T::ExpandType;
}

impl<T: LaunchArg> LaunchArg for In<T> {
    type RuntimeArg<R: Runtime> = T::RuntimeArg<R>;
    type CompilationArg = T::CompilationArg;

    fn register<R: Runtime>(arg: Self::RuntimeArg<R>, launcher: &mut KernelLauncher<R>) -> Self::CompilationArg {
        T::register(arg, launcher)
    }

    fn expand(arg: &Self::CompilationArg, builder: &mut KernelBuilder) -> T::ExpandType {
        T::expand(arg, builder)
    }

    fn expand_output(arg: &Self::CompilationArg, builder: &mut KernelBuilder) -> T::ExpandType {
        T::expand(arg, builder)
    }
}

/// The kernel side of a card (`kernels::cards`): the struct `$name` with one public field per
/// card field, `map` and `read` fields wrapped in [`In`]. The compilation arguments' and the
/// host's names are not used here.
macro_rules! device_card {
    ($(#[$m:meta])* $name:ident<$($g:ident: $b:ident),*>, $comp:ident / $host:ident { $($fields:tt)* }) => {
        $crate::kernels::card::device_card!(@fields [$(#[$m])* $name<$($g: $b),*>] [] $($fields)*);
    };
    (@fields $head:tt [$($acc:tt)*] $(#[$fm:meta])* map $f:ident: $t:ty $(, $($rest:tt)*)?) => {
        $crate::kernels::card::device_card!(@fields $head [$($acc)* $(#[$fm])* pub $f: $crate::kernels::card::In<$t>,] $($($rest)*)?);
    };
    (@fields $head:tt [$($acc:tt)*] $(#[$fm:meta])* read $f:ident: $t:ty $(, $($rest:tt)*)?) => {
        $crate::kernels::card::device_card!(@fields $head [$($acc)* $(#[$fm])* pub $f: $crate::kernels::card::In<$t>,] $($($rest)*)?);
    };
    (@fields $head:tt [$($acc:tt)*] $(#[$fm:meta])* write $f:ident: $t:ty $(, $($rest:tt)*)?) => {
        $crate::kernels::card::device_card!(@fields $head [$($acc)* $(#[$fm])* pub $f: $t,] $($($rest)*)?);
    };
    (@fields $head:tt [$($acc:tt)*] $(#[$fm:meta])* scalar $f:ident: $t:ty $(, $($rest:tt)*)?) => {
        $crate::kernels::card::device_card!(@fields $head [$($acc)* $(#[$fm])* pub $f: $t,] $($($rest)*)?);
    };
    (@fields [$(#[$m:meta])* $name:ident<$($g:ident: $b:ident),*>] [$($acc:tt)*]) => {
        $(#[$m])*
        #[derive(CubeType, CubeLaunch)]
        pub struct $name<$($g: $b),*> {
            $($acc)*
        }
    };
}
pub(crate) use device_card;
