/* A stand-in NVRTC for scripts/dry-run.sh: every compile succeeds with a 16-byte dummy image (the
 * stub driver "loads" it), so kernels are generated and launched without a compiler or a GPU. */
#include <string.h>
#include <stddef.h>
typedef int nvrtcResult; typedef void* nvrtcProgram;
static char prog[8];
nvrtcResult nvrtcCreateProgram(nvrtcProgram*p,const char*src,const char*name,int n,const char*const*h,const char*const*hn){*p=prog;return 0;}
nvrtcResult nvrtcCompileProgram(nvrtcProgram p,int n,const char*const*o){return 0;}
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram p,size_t*s){*s=16;return 0;}
nvrtcResult nvrtcGetCUBIN(nvrtcProgram p,char*c){memset(c,0x5a,16);return 0;}
nvrtcResult nvrtcGetPTXSize(nvrtcProgram p,size_t*s){*s=16;return 0;}
nvrtcResult nvrtcGetPTX(nvrtcProgram p,char*c){memset(c,0x5a,15);c[15]=0;return 0;}
nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram p,size_t*s){*s=1;return 0;}
nvrtcResult nvrtcGetProgramLog(nvrtcProgram p,char*c){c[0]=0;return 0;}
nvrtcResult nvrtcDestroyProgram(nvrtcProgram*p){return 0;}
nvrtcResult nvrtcVersion(int*a,int*b){*a=13;*b=0;return 0;}
const char* nvrtcGetErrorString(nvrtcResult r){return "stub";}
