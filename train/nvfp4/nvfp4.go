// Package nvfp4 is NVFP4 fake quantization for quantization-aware
// distillation (QAD), and the packed form for export, following NVIDIA
// Model-Optimizer (modelopt/torch/quantization: triton/fp4_kernel.py
// fp4_fake_quant_block for the training forward, qtensor/nvfp4_tensor.py
// for export). Every step below is ModelOpt's, in fp32:
//
//	g   = amax / (6·448)                     per-tensor scale (weight_scale_2, input_scale)
//	b   = max|x| over 16 consecutive elements of a row (the input dimension)
//	sb  = E4M3(min(b / (6·g'), 448))         g' = g, or 1e-12 when g = 0; E4M3 rounds to nearest even
//	s   = sb · g ;  s = 1 if s < 1e-5        (ModelOpt's guard; also covers all-zero blocks)
//	y   = sign(x) · E2M1(|x| / s) · s        E2M1 ∈ {0,.5,1,1.5,2,3,4,6}, nearest, ties to even, saturating at 6
//
// amax is the calibrated per-tensor max |x| (max over the calibration
// batches, then frozen, see Quantizer): when weights or activations later
// grow past it, sb saturates at 448 and values clip to ±6·s — the
// behaviour of a stale amax in ModelOpt too. The backward is straight-
// through: the gradient passes unchanged (ModelOpt's dynamic block quant
// uses pass_through_bwd=True), which the caller gets by using the
// quantized tensors as the forward inputs of Linear and then treating the
// gradient with respect to them as the gradient of the originals.
//
// Export layout (ModelOpt HF checkpoint, quant_algo NVFP4): weight (OC,C/2)
// uint8 with element 2i in the low nibble and 2i+1 in the high nibble, each
// nibble sign<<3 | index into the E2M1 values; weight_scale (OC,C/16) E4M3
// bytes; weight_scale_2 = g of the weight (fp32 scalar); input_scale = g of
// the input quantizer. Dequantizing gives E2M1·(E4M3·weight_scale_2), the
// same fp32 products as the fake quantization, bit for bit.
package nvfp4

import (
	"errors"
	"fmt"
	"math"

	"distill/train/internal/par"
)

// BlockSize is the number of elements sharing one E4M3 scale.
const BlockSize = 16

// ErrInvalid is wrapped by errors about shapes or scales that cannot be
// quantized or exported.
var ErrInvalid = errors.New("nvfp4: invalid input")

// e2m1Values are the magnitudes of the 3-bit E2M1 codes 0..7.
var e2m1Values = [8]float32{0, 0.5, 1, 1.5, 2, 3, 4, 6}

// E2M1 rounds a non-negative scaled magnitude to the nearest E2M1 value,
// ties to the even code, saturating at 6; it returns the value and its
// 3-bit code. The thresholds are ModelOpt's (<= at ties that go down,
// < at ties that go up).
func E2M1(a float32) (float32, uint8) {
	switch {
	case a <= 0.25:
		return 0, 0
	case a < 0.75:
		return 0.5, 1
	case a <= 1.25:
		return 1, 2
	case a < 1.75:
		return 1.5, 3
	case a <= 2.5:
		return 2, 4
	case a < 3.5:
		return 3, 5
	case a <= 5:
		return 4, 6
	}
	return 6, 7
}

// E4M3 rounds x to the nearest float8 E4M3FN value, ties to even,
// saturating at ±448 (the satfinite conversion of the GPU kernels; the
// callers here never pass more than 448 anyway). NaN stays NaN.
func E4M3(x float32) float32 {
	if x != x {
		return x
	}
	a := math.Abs(float64(x))
	if a == 0 {
		return x
	}
	_, e := math.Frexp(a) // a = f·2^e, f in [0.5,1): floor(log2 a) = e-1
	q := e - 1 - 3        // quantum 2^(exponent-3) for normals
	if e-1 < -6 {
		q = -9 // subnormals: multiples of 2^-9
	}
	r := math.Ldexp(math.RoundToEven(math.Ldexp(a, -q)), q)
	r = math.Min(r, 448)
	return float32(math.Copysign(r, float64(x)))
}

// E4M3Byte encodes an E4M3 value (as E4M3 returns) in its byte form.
func E4M3Byte(v float32) uint8 {
	var s uint8
	if math.Signbit(float64(v)) {
		s = 0x80
	}
	a := math.Abs(float64(v))
	if a == 0 {
		return s
	}
	if a < 1.0/64 {
		return s | uint8(a*512) // subnormal: mantissa·2^-9
	}
	f, e := math.Frexp(a) // a = (2f)·2^(e-1), 2f in [1,2)
	exp := uint8(e - 1 + 7)
	mant := uint8(math.Round((2*f - 1) * 8))
	return s | exp<<3 | mant
}

// E4M3Value decodes an E4M3FN byte.
func E4M3Value(b uint8) float32 {
	exp, mant := int(b>>3)&15, float64(b&7)
	var v float64
	switch {
	case exp == 15 && mant == 7:
		v = math.NaN()
	case exp == 0:
		v = mant / 512
	default:
		v = math.Ldexp(1+mant/8, exp-7)
	}
	if b&0x80 != 0 {
		v = -v
	}
	return float32(v)
}

// GlobalScale is amax/(6·448) in fp32, ModelOpt's per-tensor scale.
func GlobalScale(amax float32) float32 { return amax / (6 * 448) }

// blockScale returns the effective scale s of a block with max |x| = b
// and the E4M3 value sb it came from.
func blockScale(b, g float32) (s, sb float32) {
	gs := g
	if !(gs > 0) {
		gs = 1e-12
	}
	sb = E4M3(min(b/(6*gs), 448))
	s = sb * g
	if !(s >= 1e-5) {
		s = 1
	}
	return s, sb
}

// FakeQuant: src (rows, cols) -> dst (rows, cols), NVFP4 fake quantization
// with blocks of 16 along each row (the last block of a row may be shorter
// when cols is not a multiple of 16; it is treated as zero-padded, as the
// Triton kernel does). dst may alias src.
func FakeQuant(dst, src []float32, rows, cols int, amax float32) {
	g := GlobalScale(amax)
	par.Rows(rows, cols*4, func(_, lo, hi int) {
		for r := lo; r < hi; r++ {
			for b0 := 0; b0 < cols; b0 += BlockSize {
				x := src[r*cols+b0 : r*cols+min(b0+BlockSize, cols)]
				y := dst[r*cols+b0 : r*cols+min(b0+BlockSize, cols)]
				var bm float32
				for _, v := range x {
					bm = max(bm, float32(math.Abs(float64(v))))
				}
				s, _ := blockScale(bm, g)
				for i, v := range x {
					q, _ := E2M1(float32(math.Abs(float64(v))) / s)
					q *= s
					if v >= 0 {
						y[i] = q
					} else {
						y[i] = -q
					}
				}
			}
		}
	})
}

// AbsMax is max |x|, what calibration observes.
func AbsMax(x []float32) float32 {
	part := make([]float32, par.Workers())
	par.Rows(len(x), 1, func(w, lo, hi int) {
		var m float32
		for _, v := range x[lo:hi] {
			m = max(m, float32(math.Abs(float64(v))))
		}
		part[w] = max(part[w], m)
	})
	var m float32
	for _, v := range part {
		m = max(m, v)
	}
	return m
}

// Quantizer holds one tensor's calibrated amax. While calibrating, Observe
// raises Amax to the max |x| seen (ModelOpt's max calibrator); Freeze ends
// calibration and Amax stays fixed for the rest of training.
type Quantizer struct {
	Amax        float32
	Calibrating bool
}

// Observe records x during calibration; a no-op once frozen.
func (q *Quantizer) Observe(x []float32) {
	if q.Calibrating {
		q.Amax = max(q.Amax, AbsMax(x))
	}
}

// Freeze ends calibration. An amax of 0 (a tensor that was all zeros
// through calibration) is an error: every value would quantize to zero
// forever, and the export's scales would be 0.
func (q *Quantizer) Freeze(name string) error {
	q.Calibrating = false
	if !(q.Amax > 0) || math.IsInf(float64(q.Amax), 0) {
		return fmt.Errorf("%w: %s: calibrated amax is %g; calibrate on batches where this tensor is non-zero and finite", ErrInvalid, name, q.Amax)
	}
	return nil
}

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
			s, sb := blockScale(bm, g)
			guarded := !(sb*g >= 1e-5)
			for i, v := range x {
				_, c := E2M1(float32(math.Abs(float64(v))) / s)
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
			p.WeightScale[r*nb+b] = E4M3Byte(sb)
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
			s := E4M3Value(p.WeightScale[r*nb+c/BlockSize]) * p.WeightScale2
			v := e2m1Values[code&7] * s
			if code&8 != 0 {
				v = -v
			}
			out[r*p.Cols+c] = v
		}
	}
	return out
}
