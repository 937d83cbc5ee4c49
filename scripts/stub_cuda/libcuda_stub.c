/* A stand-in CUDA driver for machines without a GPU (development aid, never shipped): it answers the
 * device queries of one sm_90 device with 132 multiprocessors, hands out fake device addresses and
 * does nothing for copies and launches (device-to-host copies return zeros). With it, CubeCL's
 * CUDA client can be created, so the kernels' CUDA source can be generated
 * (src/backend/cuda/kernel_dump.rs) and the whole host path (plans, workspaces, launch arguments)
 * runs: scripts/dry-run.sh. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef int CUresult; typedef int CUdevice; typedef void* CUcontext; typedef void* CUstream;
CUresult cuInit(unsigned f){return 0;}
CUresult cuDeviceGet(CUdevice*d,int o){*d=0;return 0;}
CUresult cuDeviceGetCount(int*c){*c=1;return 0;}
CUresult cuDriverGetVersion(int*v){*v=13000;return 0;}
CUresult cuDeviceGetAttribute(int*v,int a,CUdevice d){
  switch(a){
    case 75: *v=9; break; case 76: *v=0; break; /* cc major/minor */
    case 10: *v=32; break; /* warp */
    case 97: *v=232448; break; /* max smem optin */
    case 1: *v=1024; break; case 2: *v=1024; break; case 3: *v=1024; break; case 4: *v=64; break;
    case 5: *v=2147483647; break; case 6: *v=65535; break; case 7: *v=65535; break;
    case 16: *v=132; break;
    default: *v=1; }
  return 0;}
static char ctxbuf[64];
CUresult cuDevicePrimaryCtxRetain(CUcontext*c,CUdevice d){*c=ctxbuf;return 0;}
CUresult cuCtxSetCurrent(CUcontext c){return 0;}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d){return 0;}
CUresult cuCtxGetCurrent(CUcontext*c){*c=ctxbuf;return 0;}
CUresult cuCtxPushCurrent_v2(CUcontext c){return 0;}
CUresult cuCtxPopCurrent_v2(CUcontext*c){*c=ctxbuf;return 0;}
CUresult cuDeviceTotalMem_v2(size_t*b,CUdevice d){*b=(size_t)140<<30;return 0;}
static char sbuf[64];
CUresult cuStreamCreate(CUstream*s,unsigned f){*s=sbuf;return 0;}
CUresult cuStreamCreateWithPriority(CUstream*s,unsigned f,int p){*s=sbuf;return 0;}
CUresult cuGetErrorString(CUresult e,const char**s){*s="stub";return 0;}
CUresult cuGetErrorName(CUresult e,const char**s){*s="stub";return 0;}
static char modbuf[64], fbuf[64];
CUresult cuModuleLoadData(void**m,const void*img){*m=modbuf;return 0;}
CUresult cuModuleGetFunction(void**f,void*m,const char*n){*f=fbuf;return 0;}
CUresult cuFuncSetAttribute(void*f,int a,int v){return 0;}
CUresult cuStreamDestroy_v2(CUstream s){return 0;}
CUresult cuMemGetInfo_v2(size_t*f,size_t*t){*f=(size_t)130<<30;*t=(size_t)140<<30;return 0;}
static uint64_t next_ptr = 0x700000000000ull;
CUresult cuMemAlloc_v2(uint64_t*p,size_t n){*p=next_ptr; next_ptr += (n+0xfffff)&~0xfffffull; return 0;}
CUresult cuMemAllocAsync(uint64_t*p,size_t n,CUstream s){return cuMemAlloc_v2(p,n);}
CUresult cuMemFree_v2(uint64_t p){return 0;}
CUresult cuMemFreeAsync(uint64_t p,CUstream s){return 0;}
CUresult cuMemcpyHtoD_v2(uint64_t d,const void*s,size_t n){return 0;}
CUresult cuMemcpyHtoDAsync_v2(uint64_t d,const void*s,size_t n,CUstream st){return 0;}
CUresult cuMemcpyDtoH_v2(void*d,uint64_t s,size_t n){memset(d,0,n);return 0;}
CUresult cuMemcpyDtoHAsync_v2(void*d,uint64_t s,size_t n,CUstream st){memset(d,0,n);return 0;}
CUresult cuMemcpyDtoDAsync_v2(uint64_t d,uint64_t s,size_t n,CUstream st){return 0;}
CUresult cuMemcpyDtoD_v2(uint64_t d,uint64_t s,size_t n){return 0;}
CUresult cuMemsetD8Async(uint64_t d,unsigned char v,size_t n,CUstream s){return 0;}
CUresult cuMemsetD8_v2(uint64_t d,unsigned char v,size_t n){return 0;}
CUresult cuMemsetD32Async(uint64_t d,unsigned v,size_t n,CUstream s){return 0;}
CUresult cuStreamSynchronize(CUstream s){return 0;}
CUresult cuCtxSynchronize(void){return 0;}
CUresult cuTensorMapEncodeTiled(void*m,int ty,unsigned rank,void*a,const uint64_t*dims,const uint64_t*strides,const unsigned*box,const unsigned*es,int il,int sw,int l2,int oob){memset(m,0,128);return 0;}
CUresult cuLaunchKernel(void*f,unsigned gx,unsigned gy,unsigned gz,unsigned bx,unsigned by,unsigned bz,unsigned sm,CUstream s,void**p,void**e){return 0;}
static char evbuf[64];
CUresult cuEventCreate(void**e,unsigned f){*e=evbuf;return 0;}
CUresult cuEventRecord(void*e,CUstream s){return 0;}
CUresult cuEventSynchronize(void*e){return 0;}
CUresult cuEventQuery(void*e){return 0;}
CUresult cuEventElapsedTime(float*ms,void*a,void*b){*ms=1.0f;return 0;}
CUresult cuEventDestroy_v2(void*e){return 0;}
CUresult cuStreamWaitEvent(CUstream s,void*e,unsigned f){return 0;}
CUresult cuStreamIsCapturing(CUstream s,int*st){*st=0;return 0;}
CUresult cuMemAllocHost_v2(void**p,size_t n){*p=malloc(n);return 0;}
CUresult cuMemFreeHost(void*p){free(p);return 0;}
CUresult cuCtxGetDevice(CUdevice*d){*d=0;return 0;}
CUresult cuDeviceGetName(char*n,int len,CUdevice d){strncpy(n,"stub sm_90",len);return 0;}
CUresult cuPointerGetAttribute(void*data,int attr,uint64_t p){memset(data,0,8);return 0;}
CUresult cuFuncGetAttribute(int*v,int a,void*f){*v=0;return 0;}
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int*n,void*f,int b,size_t s){*n=2;return 0;}
