// Package nvfp4 packs NVFP4 fake-quantized weights for export, in NVIDIA
// Model-Optimizer's HF checkpoint layout (quant_algo NVFP4;
// modelopt/torch/quantization/qtensor/nvfp4_tensor.py). The quantization
// itself (E2M1 values, E4M3 block scales, the per-tensor scale amax/(6·448))
// is defined once in package compute and run during training by the
// backend's FakeQuantNVFP4 kernel; Pack applies the same definitions, so
// the export dequantizes to the trained fake-quantized weights bit for bit.
//
// Export layout: weight (OC,C/2) uint8 with element 2i in the low nibble
// and 2i+1 in the high nibble, each nibble sign<<3 | index into the E2M1
// values; weight_scale (OC,C/16) E4M3 bytes; weight_scale_2 = g of the
// weight (fp32 scalar); input_scale = g of the input quantizer.
// Dequantizing gives E2M1·(E4M3·weight_scale_2), the same fp32 products as
// the fake quantization, bit for bit.
package nvfp4

import (
	"errors"
	"fmt"
	"math"

	"distill/compute"
)

// BlockSize is the number of elements sharing one E4M3 scale.
const BlockSize = compute.NVFP4BlockSize

// ErrInvalid is wrapped by errors about shapes or scales that cannot be
// exported.
var ErrInvalid = errors.New("nvfp4: invalid input")

// GlobalScale is amax/(6·448) in fp32, ModelOpt's per-tensor scale
// (weight_scale_2, input_scale).
func GlobalScale(amax float32) float32 { return compute.NVFP4GlobalScale(amax) }

// Packed is one Linear weight in ModelOpt's NVFP4 export layout.
type Packed struct {
	Rows, Cols   int
	Weight       []uint8 // (Rows, Cols/2), element 2i in the low nibble
	WeightScale  []uint8 // (Rows, Cols/16) E4M3 bytes
	WeightScale2 float32 // amax/(6·448) of the weight
}

// Pack quantizes w (rows, cols) with the weight amax exactly as FakeQuant
// does and packs it. Blocks whose scale fell under ModelOpt's 1e-5 guard
// are written as zeros with scale byte E4M3(1.0) for an all-zero block
// (ModelOpt's export writes 1.0 where the block scale is 0); a guarded
// block that would keep non-zero values (possible only with a stale,
// far too small amax) cannot be expressed as E4M3·weight_scale_2 and is an
// error naming the block.
func Pack(name string, w []float32, rows, cols int, amax float32) (*Packed, error) {
	if cols%BlockSize != 0 {
		return nil, fmt.Errorf("%w: %s: %d columns is not a multiple of the NVFP4 block size %d", ErrInvalid, name, cols, BlockSize)
	}
	if len(w) != rows*cols {
		return nil, fmt.Errorf("%w: %s: %d values for shape (%d,%d)", ErrInvalid, name, len(w), rows, cols)
	}
	if !(amax > 0) || math.IsInf(float64(amax), 0) {
		return nil, fmt.Errorf("%w: %s: amax %g; calibrate the weight quantizer first", ErrInvalid, name, amax)
	}
	g := GlobalScale(amax)
	nb := cols / BlockSize
	p := &Packed{Rows: rows, Cols: cols, Weight: make([]uint8, rows*cols/2), WeightScale: make([]uint8, rows*nb), WeightScale2: g}
	codes := make([]uint8, BlockSize)
	for r := 0; r < rows; r++ {
		for b := 0; b < nb; b++ {
			x := w[r*cols+b*BlockSize : r*cols+(b+1)*BlockSize]
			var bm float32
			for _, v := range x {
				bm = max(bm, float32(math.Abs(float64(v))))
			}
			s, sb := compute.NVFP4BlockScale(bm, g)
			guarded := !(sb*g >= 1e-5)
			for i, v := range x {
				_, c := compute.E2M1(float32(math.Abs(float64(v))) / s)
				if guarded && c != 0 {
					return nil, fmt.Errorf("%w: %s: row %d block %d: block scale %g is under ModelOpt's 1e-5 guard but the block keeps value %g; the weight amax %g is stale, recalibrate before export",
						ErrInvalid, name, r, b, sb*g, v, amax)
				}
				if v < 0 {
					c |= 8
				}
				codes[i] = c
			}
			if sb == 0 {
				sb = 1
			}
			p.WeightScale[r*nb+b] = compute.E4M3Byte(sb)
			for i := 0; i < BlockSize; i += 2 {
				p.Weight[(r*cols+b*BlockSize+i)/2] = codes[i] | codes[i+1]<<4
			}
		}
	}
	return p, nil
}

// Dequantize expands the packed form back to fp32 (rows, cols), as
// ModelOpt's NVFP4QTensor.dequantize: E2M1 · (E4M3(scale) · scale_2).
func (p *Packed) Dequantize() []float32 {
	out := make([]float32, p.Rows*p.Cols)
	nb := p.Cols / BlockSize
	for r := 0; r < p.Rows; r++ {
		for c := 0; c < p.Cols; c++ {
			byt := p.Weight[(r*p.Cols+c)/2]
			code := byt & 15
			if c%2 == 1 {
				code = byt >> 4
			}
			s := compute.E4M3Value(p.WeightScale[r*nb+c/BlockSize]) * p.WeightScale2
			v := compute.E2M1Values[code&7] * s
			if code&8 != 0 {
				v = -v
			}
			out[r*p.Cols+c] = v
		}
	}
	return out
}
