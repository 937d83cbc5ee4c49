//! The host side of the kernel cards (`kernels::card`, `kernels::cards`): per card a struct of its
//! launch arguments by name (`FwdArgs`, `DkdvArgs`, `DqArgs`), whose `args` pushes them in the card's order,
//! and the card's compilation arguments. A launch fills every field by name, so it cannot pass
//! them in another order than the kernels declare, nor leave one out.

use cubecl::prelude::*;

use super::launch::{Args, MapArg};
use crate::kernels::cards::{dkdv_card, dq_card, fwd_card};

/// The host side of one card: `map` fields are [`MapArg`]s, `read` and `write` fields (device
/// address, length in the field's element type), `scalar` fields their value.
macro_rules! host_card {
    ($(#[$m:meta])* $name:ident<$($g:ident: $b:ident),*>, $comp:ident / $host:ident {
        $($(#[$fm:meta])* $kind:ident $f:ident: $t:ty),* $(,)?
    }) => {
        #[doc = concat!("The launch arguments of `kernels::cards::", stringify!($name), "` by name.")]
        pub(crate) struct $host {
            $(pub $f: host_card!(@ty $kind $t)),*
        }

        impl $host {
            /// The kernels' compilation arguments for the card: every array a plain one (not in place).
            pub fn compilation<$($g: $b),*>() -> crate::kernels::cards::$comp<$($g),*> {
                crate::kernels::cards::$comp { $($f: host_card!(@comp $kind)),* }
            }

            /// The launch arguments in the card's order.
            pub fn args(&self) -> Args {
                let mut a = Args::new();
                $(host_card!(@push a $kind self.$f);)*
                a
            }
        }
    };
    (@ty map $t:ty) => { MapArg };
    (@ty read $t:ty) => { (u64, usize) };
    (@ty write $t:ty) => { (u64, usize) };
    (@ty scalar $t:ty) => { $t };
    (@comp map) => { () };
    (@comp read) => { ArrayCompilationArg { inplace: None } };
    (@comp write) => { ArrayCompilationArg { inplace: None } };
    (@comp scalar) => { () };
    (@push $a:ident map $v:expr) => { $a.tensor_map(&$v) };
    (@push $a:ident read $v:expr) => { $a.array($v.0, $v.1) };
    (@push $a:ident write $v:expr) => { $a.array($v.0, $v.1) };
    (@push $a:ident scalar $v:expr) => { $a.scalar($v) };
}

fwd_card!(host_card);
dkdv_card!(host_card);
dq_card!(host_card);
